"""Where a NIXL write reads and lands: (address, bytes, device) descriptors that pair the
sender's pool slots with the receiver's, plane by plane. Pure numpy, so it is tested
without NIXL.

A pool is [num_layers, 2, num_slots, num_kv_heads, head_dim] (engine/kv_cache.py): in each
of its 2 * num_layers planes a run of consecutive slots is one contiguous range, so a write
is one descriptor per plane per run that is consecutive on *both* sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine_shim.engine.api import InvalidRequestError


@dataclass(frozen=True)
class PoolRegion:
    """Where one pool's planes lie: plane p's slot s starts at base + p * plane_bytes +
    s * slot_bytes."""

    base: int
    num_planes: int
    plane_bytes: int
    slot_bytes: int
    device_id: int

    @property
    def num_slots(self) -> int:
        return self.plane_bytes // self.slot_bytes

    def bytes_of(self, num_slots: int) -> int:
        """Bytes that `num_slots` slots hold, over every plane."""
        return num_slots * self.slot_bytes * self.num_planes


def segment_slots(kv_segments: Sequence[int]) -> np.ndarray:
    """MLC's [n, begin_1, len_1, ...] slot list -> every slot, in order (int64)."""
    if not kv_segments or len(kv_segments) != 1 + 2 * kv_segments[0]:
        raise InvalidRequestError("kv_segments must be [n, begin_1, len_1, ..., begin_n, len_n]")
    pairs = np.asarray(kv_segments[1:], dtype=np.int64).reshape(-1, 2)
    if (pairs[:, 0] < 0).any() or (pairs[:, 1] < 1).any():
        raise InvalidRequestError("kv_segments hold a negative slot or an empty run")
    return np.concatenate([np.arange(b, b + n, dtype=np.int64) for b, n in pairs])


def paired_runs(
    local_slots: np.ndarray, remote_slots: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local starts, remote starts, lengths) of the runs consecutive on both sides."""
    if len(local_slots) != len(remote_slots) or len(local_slots) == 0:
        raise InvalidRequestError(
            f"the sender holds {len(local_slots)} slots for the {len(remote_slots)} reserved"
        )
    breaks = (np.diff(local_slots) != 1) | (np.diff(remote_slots) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    lengths = np.diff(np.concatenate((starts, [len(local_slots)])))
    return local_slots[starts], remote_slots[starts], lengths


def descriptors(region: PoolRegion, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[num_planes * num_runs, 3] uint64 rows (address, bytes, device id), plane-major; the
    rows of two pools built from paired runs correspond one to one."""
    if (starts < 0).any() or (starts + lengths > region.num_slots).any():
        raise InvalidRequestError("a slot run lies outside the pool region")
    planes = np.arange(region.num_planes, dtype=np.uint64)[:, None]
    offsets = starts.astype(np.uint64)[None, :] * np.uint64(region.slot_bytes)
    addresses = np.uint64(region.base) + planes * np.uint64(region.plane_bytes) + offsets
    sizes = np.broadcast_to(lengths.astype(np.uint64) * np.uint64(region.slot_bytes), addresses.shape)
    rows = np.empty((addresses.size, 3), dtype=np.uint64)
    rows[:, 0] = addresses.reshape(-1)
    rows[:, 1] = sizes.reshape(-1)
    rows[:, 2] = region.device_id
    return rows
