"""The KV tensors of the page pool and the slot-level copies that move KV in and out.

kv: [num_layers, 2 (key, value), num_pages * page_size, num_kv_heads, head_dim]. A slot is
one token position of one page (`page_id * page_size + offset`), the unit MLC's
kv_append_metadata speaks in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from .block_manager import Slots, slot_runs
from .config import ModelConfig


class KVCache:
    """The pool's pages plus, past them, one scratch page that belongs to no sequence: CUDA-graph
    replays pad their batch with rows that write there (`scratch_slot`)."""

    def __init__(
        self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
        device: str,
    ) -> None:
        self.num_slots = num_pages * page_size
        self.scratch_slot = self.num_slots  # first slot of the scratch page
        shape = (config.num_layers, 2, self.num_slots + page_size, config.num_kv_heads, config.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def token_bytes(self) -> int:
        """Bytes of one position's KV over all layers (keys and values)."""
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * config.num_kv_heads * config.head_dim * element

    def export_slots(self, slots: Sequence[int] | Slots, out: torch.Tensor | None = None) -> torch.Tensor:
        """-> [num_layers, 2, n, num_kv_heads, head_dim]: a contiguous CPU copy, or `out`
        (contiguous, any device, e.g. a shared-memory stage) filled and returned.

        Copies runs of consecutive slots (a page's slots are consecutive) as slices:
        index_select along the slot axis ran at under 1 GB/s on the CPU, slices at memcpy
        speed."""
        # cat copies once (also for a single run), so the result never aliases the pool.
        pieces = [self.kv[:, :, a:b] for a, b in slot_runs(slots)] or [self.kv[:, :, :0]]
        with _one_thread():
            if out is None:
                return torch.cat(pieces, dim=2).to("cpu")  # no-op on the CPU, one copy on CUDA
            if out.device == self.kv.device:
                return torch.cat(pieces, dim=2, out=out)
            # Gathered on the pool's device first: one transfer instead of one per run.
            return out.copy_(torch.cat(pieces, dim=2))

    def import_slots(self, slots: Sequence[int] | Slots, data: torch.Tensor) -> None:
        # data: [num_layers, 2, n, num_kv_heads, head_dim], on any device: moved once to the
        # pool's (a no-op there), then copied run by run.
        with _one_thread():
            data = data.to(self.kv.device)
            offset = 0
            for start, stop in slot_runs(slots):
                self.kv[:, :, start:stop].copy_(data[:, :, offset : offset + stop - start])
                offset += stop - start

    def copy_slots(self, src: Sequence[int] | Slots, dst: Sequence[int] | Slots) -> None:
        if not len(src):
            return
        index = torch.as_tensor(np.asarray(src, dtype=np.int64), device=self.kv.device)
        self.import_slots(dst, self.kv.index_select(2, index))


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """KV copies run on the calling thread alone. They are memory-bound, so a second OpenMP
    thread adds little at best, and on a busy host it costs a lot: on the shared 2-core box,
    two 16 MiB copies took a median 26 ms with 2 threads against 6 ms with 1 (best 2.3 vs
    2.6 ms), the team's barrier waiting for a descheduled thread. Only the engine thread runs
    torch compute, and the setting is restored before the model runs again."""
    num_threads = torch.get_num_threads()
    if num_threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)
