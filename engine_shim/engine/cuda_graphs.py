"""CUDA-graph replay of the decode step (one new token per sequence).

At batch 1 a decode step of a small model is bound by kernel launches, not by memory: the
graphs remove the launches. One graph is captured per batch-size bucket; a step with B
sequences replays the smallest bucket >= B with the extra rows padded. Padded rows write their
K/V into a scratch slot that belongs to no page of the pool and attend over that slot alone,
so they never touch a real sequence's KV.

All metadata lives in static tensors (token ids, positions, slot mapping, block tables,
context lengths) that are filled before each replay; the decode attention kernel reads its
loop bounds from them on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .attention import AttnContext, PagedDecode
from .model import CausalLM

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab] fp32, written by the replay


class DecodeGraphRunner:
    def __init__(
        self, model: CausalLM, kv: torch.Tensor, page_size: int, max_pages_per_seq: int,
        scratch_slot: int, max_batch: int, buckets: Sequence[int] = DEFAULT_BUCKETS,
    ) -> None:
        self.model = model
        self.kv = kv
        self.page_size = page_size
        self.scratch_slot = scratch_slot
        self.buckets = tuple(b for b in buckets if b <= max_batch) or (max_batch,)
        device = kv.device
        size = self.buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), scratch_slot, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(size, max_pages_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(size, dtype=torch.int32, device=device)
        self._graphs: dict[int, _Captured] = {}
        self.num_replays = 0
        self._pool: Any = None  # the first graph's memory pool handle, shared by the others

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _context(self, n: int) -> AttnContext:
        return AttnContext(
            slot_mapping=self.slot_mapping[:n], seqs=[],
            paged_decode=PagedDecode(self.block_tables[:n], self.context_lens[:n], self.page_size),
        )

    def _forward(self, n: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:n], self.positions[:n], self.kv, self._context(n))
        return self.model.logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool."""
        self._reset_padding(0)
        # One stream for warm-up and capture, so the cuBLAS workspace a warm-up allocates is
        # the one the capture uses. Thread-local capture: the engine captures on its own
        # thread while the server's threads keep running (global mode would let any CUDA
        # call elsewhere in the process invalidate the capture).
        stream = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: autotuning and lazy allocations happen here
                    self._forward(bucket)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"
            ):
                logits = self._forward(bucket)
            self._pool = graph.pool()
            self._graphs[bucket] = _Captured(graph, logits)
        torch.cuda.synchronize()

    def _reset_padding(self, start: int) -> None:
        # Rows past the live batch: scratch slot, scratch page, one visible key.
        self.slot_mapping[start:].fill_(self.scratch_slot)
        self.block_tables[start:].fill_(self.scratch_slot // self.page_size)
        self.context_lens[start:].fill_(1)
        self.positions[start:].zero_()
        self.input_ids[start:].zero_()

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
        block_tables: torch.Tensor, context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Inputs for B live rows (block_tables [B, pages] may be narrower than the static
        table). Returns logits [B, vocab] fp32 (a view into the graph's output)."""
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        if bucket is None or bucket not in self._graphs:
            raise ValueError(f"no captured graph for batch {n}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.block_tables[:n, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.context_lens[:n].copy_(context_lens, non_blocking=True)
        self._reset_padding(n)
        captured = self._graphs[bucket]
        captured.graph.replay()
        self.num_replays += 1
        return captured.logits[:n]
