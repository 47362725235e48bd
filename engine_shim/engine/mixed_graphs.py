"""CUDA-graph replay of steps that prefill (mixed steps: prompts beside decodes, and prompt
steps alone).

Under serving load a new prompt arrives every step or two, so most steps prefill beside the
decode batch. Such a step used to run the model eagerly: about twelve launches a layer from
Python (GEMMs, the fused elementwise kernels, both attention kernels and the gathers between
them), 200 for a 16-layer model, which kept the engine core CPU-bound on an H200 while a pure
decode step cost one graph replay (docs/throughput.md, runs 7-9).

Here a mixed step replays a graph captured for its number of tokens, rounded up to a bucket:
- the step is laid out **decode rows first**: rows [0, B) decode one token each, then each
  prefilling sequence's rows; padding rows up to the bucket write their K/V into the pool's
  scratch slot and attend to nothing;
- attention is two launches a layer with tensor-only metadata: the decode kernel over every
  row of the bucket (a row's keys visible are its context length, 0 for prefill and padding
  rows, which come out zero), then the prefill kernel over a fixed number of query tiles
  (tiles past the step's hold no queries and exit at once) overwriting the prefill rows;
- both kernels read one block table: the decode rows' tables in rows [0, B), the prefilling
  sequences' after them.
All metadata is one int64 device buffer filled by a single copy from a pinned host buffer
per step. The rows to sample are gathered and the LM head applied after the replay, eagerly
(three launches over only the rows that sample).

A step that does not fit (more tokens than the largest bucket, more prefilling sequences than
`max_prefills`, a block table wider than the graphs') runs eagerly as before. Without a
capture (the CPU, under Triton's interpreter) `run` computes the same static-shape forward
eagerly, which is how the CPU tests check the layout against the per-step path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attention import AttnContext, PagedDecode, StaticMixed
from .cuda_graphs import TableRows, capture_buckets
from .model import CausalLM
from .triton_prefill import PagedPrefill, PrefillRows

# Tokens a step, rounded up to one of these (the largest is capped at the engine's own
# maximum: decode rows plus one prefill chunk). Spacing of 12-25% bounds the padding's GEMM
# work; every bucket is one captured graph sharing one memory pool.
DEFAULT_TOKEN_BUCKETS = (
    16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 576, 640, 768, 896, 1024,
    1280, 1536, 2048,
)
BLOCK_M = 64  # queries a prefill tile in the graphs (the eager path picks 16 or 64 per step)


@dataclass
class MixedLayout:
    """One step that prefills, as the runner lays it out on the host: decode rows first."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    decode_lens: list[int]  # row i < B: keys visible to decode row i, the new one included
    decode_tables: list[list[int]]
    prefills: list[PrefillRows]  # rows B onwards, q_start their first row
    sample_rows: list[int]  # rows whose hidden state gets logits, in the caller's order

    @property
    def num_tiles(self) -> int:
        return sum(-(-p.q_len // BLOCK_M) for p in self.prefills)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [bucket, H], written by the replay


def max_tiles(bucket: int, max_prefills: int) -> int:
    """Query tiles the graph of a bucket launches: sum(ceil(q / BLOCK_M)) over at most
    max_prefills sequences of at most bucket queries together."""
    return (bucket + (BLOCK_M - 1) * max_prefills) // BLOCK_M


class MixedGraphRunner:
    def __init__(
        self, model: CausalLM, kv: torch.Tensor, page_size: int, scratch_slot: int,
        max_tokens: int, max_decode_rows: int, max_pages_per_seq: int, max_prefills: int = 32,
        buckets: Sequence[int] = DEFAULT_TOKEN_BUCKETS,
    ) -> None:
        self.model = model
        self.kv = kv
        self.page_size = page_size
        self.scratch_slot = scratch_slot
        self.max_prefills = max_prefills
        self.max_decode_rows = max_decode_rows
        self.max_pages_per_seq = max_pages_per_seq
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        ordered = tuple(sorted(buckets))
        if max_tokens <= ordered[-1]:
            self.buckets = tuple(b for b in ordered if b < max_tokens) + (max_tokens,)
        else:
            self.buckets = ordered
        device = kv.device
        self.on_cuda = device.type == "cuda"
        size = self.buckets[-1]
        self._size = size
        self._tiles = max_tiles(size, max_prefills)
        rows = max_decode_rows + max_prefills
        # Layout: ids | positions | slots | decode lens | sample rows (size each) | tiles
        # (5 each) | block tables (rows x pages). A step copies the prefix through its last
        # table row.
        self._table_at = 5 * size + 5 * self._tiles
        numel = self._table_at + rows * max_pages_per_seq
        self._host = torch.zeros(numel, dtype=torch.int64, pin_memory=self.on_cuda)
        h = self._host.numpy()
        self._h_ids, self._h_pos, self._h_slots, self._h_lens, self._h_sample = (
            h[i * size : (i + 1) * size] for i in range(5)
        )
        self._h_tiles = h[5 * size : self._table_at].reshape(self._tiles, 5)
        self._h_tables = h[self._table_at :].reshape(rows, max_pages_per_seq)
        self._table_rows = TableRows(rows)
        self._device = torch.zeros(numel, dtype=torch.int64, device=device)
        d = self._device
        self.input_ids, self.positions, self.slot_mapping, self.decode_lens, self.sample_rows = (
            d[i * size : (i + 1) * size] for i in range(5)
        )
        self.tiles = d[5 * size : self._table_at].view(self._tiles, 5)
        self.block_tables = d[self._table_at :].view(rows, max_pages_per_seq)
        self._copied = torch.cuda.Event() if self.on_cuda else None
        self._graphs: dict[int, _Captured] = {}
        self.num_replays = 0
        self.num_static_runs = 0  # eager runs of the static shapes (no graph captured)

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def fits(self, step: MixedLayout) -> bool:
        bucket = self.bucket_for(len(step.input_ids))
        return (
            bucket is not None
            and len(step.prefills) <= self.max_prefills
            and len(step.decode_lens) <= self.max_decode_rows
            and step.num_tiles <= max_tiles(bucket, self.max_prefills)
            and all(len(t) <= self.max_pages_per_seq for t in step.decode_tables)
            and all(len(p.block_table) <= self.max_pages_per_seq for p in step.prefills)
        )

    def _context(self, bucket: int) -> AttnContext:
        prefill = PagedPrefill(
            self.block_tables, self.tiles[: max_tiles(bucket, self.max_prefills)], BLOCK_M,
            self.page_size,
        )
        decode = PagedDecode(self.block_tables, self.decode_lens[:bucket], self.page_size)
        return AttnContext(
            slot_mapping=self.slot_mapping[:bucket], seqs=[],
            static_mixed=StaticMixed(decode, prefill),
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv, self._context(bucket))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket (`cuda_graphs.capture_buckets`)."""
        self._fill(None, self._size)
        self._upload(self.max_decode_rows + self.max_prefills)
        captured = capture_buckets(self.buckets, self._forward)
        self._graphs = {bucket: _Captured(graph, hidden) for bucket, (graph, hidden) in captured.items()}

    def _fill(self, step: MixedLayout | None, bucket: int) -> int:
        """Write a step's metadata (None: padding only) into the host buffer; returns the
        block-table rows it uses."""
        n = 0 if step is None else len(step.input_ids)
        num_decode = 0
        if step is not None:
            num_decode = len(step.decode_lens)
            self._h_ids[:n] = step.input_ids
            self._h_pos[:n] = step.positions
            self._h_slots[:n] = step.slot_mapping
            self._h_lens[:num_decode] = step.decode_lens
            self._h_sample[: len(step.sample_rows)] = step.sample_rows
        self._h_lens[num_decode:bucket] = 0  # prefill and padding rows: no decode keys
        self._h_ids[n:bucket] = 0
        self._h_pos[n:bucket] = 0
        self._h_slots[n:bucket] = self.scratch_slot
        num_tiles = 0
        if step is not None:
            self._table_rows.write(self._h_tables, step.decode_tables)
            self._table_rows.write(self._h_tables, [p.block_table for p in step.prefills], num_decode)
            for i, p in enumerate(step.prefills):
                table_row = num_decode + i
                for m0 in range(0, p.q_len, BLOCK_M):
                    self._h_tiles[num_tiles] = (table_row, m0, p.q_start, p.q_len, p.ctx_len)
                    num_tiles += 1
        self._h_tiles[num_tiles : max_tiles(bucket, self.max_prefills)] = 0  # empty tiles
        return num_decode + (0 if step is None else len(step.prefills))

    def _upload(self, table_rows: int) -> None:
        numel = self._table_at + table_rows * self.max_pages_per_seq
        self._device[:numel].copy_(self._host[:numel], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    @torch.inference_mode()
    def run(self, step: MixedLayout) -> torch.Tensor:
        """The hidden states of the step's sample rows, [len(sample_rows), H] (a graph replay
        on CUDA once captured; the same static-shape forward run eagerly otherwise). The
        caller checked `fits(step)`."""
        bucket = self.bucket_for(len(step.input_ids))
        if bucket is None:
            raise ValueError(f"no bucket for {len(step.input_ids)} tokens")
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the pinned buffer
        self._upload(self._fill(step, bucket))
        captured = self._graphs.get(bucket)
        if captured is not None:
            captured.graph.replay()
            self.num_replays += 1
            hidden = captured.hidden
        else:
            hidden = self._forward(bucket)
            self.num_static_runs += 1
        return hidden.index_select(0, self.sample_rows[: len(step.sample_rows)])
