"""A receiver's KV pool mapped into the sender's process (CUDA IPC), so that a NIXL write
between two engines on one GPU is one copy kernel per run of slots, with NIXL carrying only
its notification.

Why: on one GPU UCX moves each write as one CUDA IPC copy per plane and run too, but NIXL's
per-write setup (two descriptor lists, initialize_xfer, transfer) costs the writing engine
core about 0.5 ms of Python and native host time for 32 descriptors (run 23, H100: 22.5% of
P's core at 64 streams), and a write of 255 tokens took 1.2-2.5 ms end to end on an idle GPU.
A copy into the receiver's pool mapped here is a few kernel launches on a stream of the
sender's own, beside its steps.

Nothing else about a write changes: the receiver offers the mapping inside its NIXL offer
(so the WriteKV digest covers it: a sender writes only by the receiver's own offer, and only
into the slots the claim names), the sender claims as before, and the receiver completes the
reservation on the same notification, sent once the copy has ended on the device (its event
queried, never waited for). The mapping is used only where it can work: the same host (boot
id), the same GPU (its UUID) as the sender's pool, another process; anything else writes
through NIXL as before.

torch's own CUDA IPC sharing is used (UntypedStorage._share_cuda_ / _new_shared_cuda: the
calls torch.multiprocessing makes for a CUDA tensor), with its fields carried as JSON, never
pickled: a peer's offer is data, not code.
"""

from __future__ import annotations

import base64
import os

import numpy as np
import torch

from engine_shim.backends.embedded.kv_plane.addr import PoolMapping
from engine_shim.backends.embedded.kv_plane.nixl_descs import PoolRegion, paired_runs
from engine_shim.backends.embedded.kv_plane.shm import host_identity
from engine_shim.engine.api import InvalidRequestError


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_pool(pool: torch.Tensor) -> PoolMapping | None:
    """The mapping of a CUDA pool that this process owns; None on the CPU or where this host
    has no identity to match on."""
    host = host_identity()
    if not pool.is_cuda or host is None:
        return None
    storage = pool.untyped_storage()
    (_, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event_handle,
     event_sync_required) = storage._share_cuda_()  # type: ignore[attr-defined]
    return PoolMapping(
        host=host, pid=os.getpid(), device_uuid=device_uuid(pool.device),
        handle=_b64(handle), storage_bytes=int(storage_bytes), storage_offset=int(storage_offset),
        ref_counter_handle=_b64(ref_handle), ref_counter_offset=int(ref_offset),
        event_handle=_b64(event_handle), event_sync_required=bool(event_sync_required),
        pool_offset=int(pool.storage_offset()) * pool.element_size(),
    )


def open_pool(mapping: PoolMapping, region: PoolRegion, local_pool: torch.Tensor) -> torch.Tensor | None:
    """The peer's pool mapped here as slot_view's [planes, slots, words], or None where
    it cannot be (another host or GPU, this very process, a CPU pool here). Raises what CUDA
    raises when the mapping itself fails."""
    if not local_pool.is_cuda or mapping.pid == os.getpid() or mapping.host != host_identity():
        return None
    if mapping.device_uuid != device_uuid(local_pool.device):
        return None
    if mapping.pool_offset + region.num_planes * region.plane_bytes > mapping.storage_bytes:
        raise InvalidRequestError("the offered pool lies outside its storage")
    storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
        local_pool.get_device(), base64.b64decode(mapping.handle), mapping.storage_bytes,
        mapping.storage_offset, base64.b64decode(mapping.ref_counter_handle),
        mapping.ref_counter_offset, base64.b64decode(mapping.event_handle),
        mapping.event_sync_required,
    )
    return slot_view(torch.empty(0, dtype=torch.uint8, device=local_pool.device).set_(
        storage, mapping.pool_offset, (region.num_planes * region.plane_bytes,), (1,)), region)


def slot_view(flat: torch.Tensor, region: PoolRegion) -> torch.Tensor:
    """A pool's bytes as [planes, slots, words of a slot] (plane p, slot s at p * plane_bytes +
    s * slot_bytes, as nixl_descs describes a pool), in 8-byte words where a slot is a
    whole number of them: a copy kernel then moves 8 bytes an element, not one (a copy of
    bytes ran at about 100 GB/s on an H100: 2.6 ms for 8,176 tokens of llama-1b)."""
    slots = flat.view(torch.uint8).reshape(region.num_planes, region.num_slots, region.slot_bytes)
    return slots.view(torch.int64) if region.slot_bytes % 8 == 0 else slots


def copy_runs(dst: torch.Tensor, src: torch.Tensor, local_slots: np.ndarray,
              remote_slots: np.ndarray) -> int:
    """Copy `local_slots` of `src` into `remote_slots` of `dst` (both slot_view's [planes,
    slots, words]), one copy of every plane per run of slots consecutive on both sides, on
    the current stream; the bytes copied. Slots outside either pool are refused first."""
    local_starts, remote_starts, lengths = paired_runs(local_slots, remote_slots)
    for starts, pool in ((local_starts, src), (remote_starts, dst)):
        if (starts < 0).any() or (starts + lengths > pool.shape[1]).any():
            raise InvalidRequestError("a slot run lies outside the pool region")
    for local, remote, length in zip(local_starts.tolist(), remote_starts.tolist(), lengths.tolist(), strict=True):
        dst[:, remote : remote + length].copy_(src[:, local : local + length], non_blocking=True)
    return int(lengths.sum()) * src.shape[0] * src.shape[2] * src.element_size()


def _b64(raw: bytes | None) -> str:
    return base64.b64encode(raw or b"").decode()
