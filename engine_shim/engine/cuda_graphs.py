"""CUDA-graph replay of the decode step (one new token per sequence).

At batch 1 a decode step of a small model is bound by kernel launches, not by memory: the
graphs remove the launches. One graph is captured per batch-size bucket; a step with B
sequences replays the smallest bucket >= B with the extra rows padded. Padded rows write their
K/V into a scratch slot that belongs to no page of the pool and attend over that slot alone,
so they never touch a real sequence's KV.

All metadata lives in static tensors (token ids, positions, slot mapping, context lengths,
block tables), views of one int64 device buffer that a single copy from a pinned host buffer
fills before each replay (one transfer a step instead of five copies and five fills); the
decode attention kernel reads its loop bounds from them on the device. The graph also takes
the argmax of every row, so a greedy step reads back only the token ids: each replay queues
their copy into a pinned host buffer of its own (a ring, so a step launched before the last
one's ids were read does not overwrite them). A chained step (LLMEngine with chain_decode)
takes its input ids from an earlier replay's argmax on the device, gathered by row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .attention import AttnContext, PagedDecode
from .model import CausalLM

T = TypeVar("T")
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


def capture_buckets(buckets: Sequence[int],
                    forward: Callable[[int], T]) -> dict[int, tuple[torch.cuda.CUDAGraph, T]]:
    """A CUDA graph of `forward(bucket)` for every bucket (ascending), with the outputs the
    replays write: largest first, so the smaller graphs reuse its memory pool. One stream for
    warm-up and capture, so the cuBLAS workspace a warm-up allocates is the one the capture
    uses. Thread-local capture: the engine captures on its own thread while the server's
    threads keep running (global mode would let any CUDA call elsewhere in the process
    invalidate the capture)."""
    captured: dict[int, tuple[torch.cuda.CUDAGraph, T]] = {}
    pool: Any = None  # the first graph's memory pool handle, shared by the others
    stream = torch.cuda.Stream()
    for bucket in reversed(buckets):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: autotuning, kernel compilation, lazy allocations
                forward(bucket)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            out = forward(bucket)
        pool = graph.pool()
        captured[bucket] = (graph, out)
    torch.cuda.synchronize()
    return captured


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab] fp32, written by the replay
    argmax: torch.Tensor  # [bucket] int64, argmax of each logits row


@dataclass
class DecodeInputs:
    """One decode step's metadata as Python ints, for B live rows. When the input ids are
    fed from the device (`Feed`), input_ids holds each row's index in the feeding step."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]


@dataclass
class Feed:
    """Input ids that live on the device: row i of the step takes source[rows[i]] (the argmax
    of an earlier step, not yet read back); the rows after those take `host_ids` (sequences
    that join the chained step, their next token on the host)."""

    source: torch.Tensor  # [rows of the earlier step] int64 on the device
    rows: list[int]
    host_ids: list[int] = field(default_factory=list)


@dataclass
class ReadBack:
    """A step's argmax on its way to a pinned host buffer."""

    host: torch.Tensor  # [B] int64, pinned
    ready: torch.cuda.Event

    def tolist(self) -> list[int]:
        self.ready.synchronize()
        return self.host.tolist()  # type: ignore[no-any-return]


class TableRows:
    """Which block table each row of a host table buffer holds, so a step rewrites only the
    rows whose table changed: in a decode batch most rows carry the same sequence as the step
    before, whose table grows by a page every page_size tokens (writing every row cost about
    1 us a row a step). A row remembers the list it was written from and its length: block
    tables are only ever extended or replaced by a new list (never edited in place), and the
    reference kept here stops a freed list's address from being reused for another one."""

    def __init__(self, rows: int) -> None:
        self._source: list[list[int] | None] = [None] * rows
        self._length = [0] * rows

    def write(self, buffer: Any, tables: Sequence[list[int]], first_row: int = 0) -> None:
        source, length = self._source, self._length
        for row, table in enumerate(tables, first_row):
            if source[row] is not table or length[row] != len(table):
                buffer[row, : len(table)] = table
                source[row], length[row] = table, len(table)

    def forget(self, start: int, end: int) -> None:
        """Rows [start, end) were overwritten some other way (padding)."""
        for row in range(start, min(end, len(self._source))):
            self._source[row] = None


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
        self.max_pages_per_seq = max_pages_per_seq
        # Layout: ids | positions | slots | context lens | fed rows (size each) | tables
        # (size x pages). The rows of a bucket b are the first b of each vector and the first
        # b table rows, so one copy of host[: 5 * size + b * pages] brings a step's metadata
        # across.
        numel = size * (5 + max_pages_per_seq)
        self._host = torch.zeros(numel, dtype=torch.int64, pin_memory=True)
        self._host_np = self._host.numpy()
        self._device = torch.zeros(numel, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event()
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, self._fed_rows = (
            self._device[i * size : (i + 1) * size] for i in range(5)
        )
        self.block_tables = self._device[5 * size :].view(size, max_pages_per_seq)
        h = self._host_np
        self._h_ids, self._h_pos, self._h_slots, self._h_lens, self._h_fed = (
            h[i * size : (i + 1) * size] for i in range(5)
        )
        self._h_tables = h[5 * size :].reshape(size, max_pages_per_seq)
        self._table_rows = TableRows(size)
        # Read-back ring: at most two steps are in flight (one launched, one being read).
        self._read_back = [
            (torch.zeros(size, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
            for _ in range(4)
        ]
        self._read_back_turn = 0
        self._graphs: dict[int, _Captured] = {}
        self.num_replays = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _context(self, n: int) -> AttnContext:
        return AttnContext(
            slot_mapping=self.slot_mapping[:n], seqs=[],
            paged_decode=PagedDecode(self.block_tables[:n], self.context_lens[:n], self.page_size),
        )

    def _forward(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self.input_ids[:n], self.positions[:n], self.kv, self._context(n))
        logits = self.model.logits(hidden)
        return logits, logits.argmax(dim=-1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket (`capture_buckets`)."""
        self._fill_padding(0, self.max_batch)
        self._upload(self.max_batch)
        captured = capture_buckets(self.buckets, self._forward)
        self._graphs = {bucket: _Captured(graph, *out) for bucket, (graph, out) in captured.items()}

    def _fill_padding(self, start: int, end: int) -> None:
        # Host rows [start, end) past the live batch: scratch slot, scratch page, one key.
        self._h_ids[start:end] = 0
        self._h_pos[start:end] = 0
        self._h_slots[start:end] = self.scratch_slot
        self._h_lens[start:end] = 1
        self._h_tables[start:end, 0] = self.scratch_slot // self.page_size
        self._table_rows.forget(start, end)

    def _upload(self, bucket: int) -> None:
        numel = 5 * self.max_batch + bucket * self.max_pages_per_seq
        self._device[:numel].copy_(self._host[:numel], non_blocking=True)
        self._copied.record()

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    @torch.inference_mode()
    def run(self, inputs: DecodeInputs, feed: Feed | None = None) -> tuple[torch.Tensor, torch.Tensor, ReadBack]:
        """Replays the graph of the smallest bucket that holds the B live rows (every block
        table no wider than max_pages_per_seq). Returns logits [B, vocab] fp32 and their
        argmax [B] int64, views into the graph's outputs (valid until the next replay of the
        bucket), and the argmax's read-back. With a feed, the input ids are gathered on the
        device from feed.source (inputs.input_ids is ignored)."""
        n = len(inputs.positions)
        bucket = self.bucket_for(n)
        if bucket is None or bucket not in self._graphs:
            raise ValueError(f"no captured graph for batch {n}")
        # The last step's copy must have left the pinned buffer before it is rewritten.
        self._copied.synchronize()
        num_fed = n if feed is None else len(feed.rows)
        if feed is None:
            self._h_ids[:n] = inputs.input_ids
        else:
            self._h_fed[:num_fed] = feed.rows
            self._h_ids[num_fed:n] = feed.host_ids
        self._h_pos[:n] = inputs.positions
        self._h_slots[:n] = inputs.slot_mapping
        self._h_lens[:n] = inputs.context_lens
        self._table_rows.write(self._h_tables, inputs.block_tables)
        self._fill_padding(n, bucket)
        self._upload(bucket)
        if feed is not None:
            # Stream-ordered: reads the earlier step's argmax before this replay rewrites it.
            torch.index_select(feed.source, 0, self._fed_rows[:num_fed], out=self.input_ids[:num_fed])
        captured = self._graphs[bucket]
        captured.graph.replay()
        self.num_replays += 1
        host, ready = self._read_back[self._read_back_turn]
        self._read_back_turn = (self._read_back_turn + 1) % len(self._read_back)
        ready.synchronize()  # its previous use was read long ago; this never waits in practice
        host[:n].copy_(captured.argmax[:n], non_blocking=True)
        ready.record()
        return captured.logits[:n], captured.argmax[:n], ReadBack(host[:n], ready)
