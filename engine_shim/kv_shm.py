"""Same-host KV through shared memory. A receiver leases each reservation a staging segment in
/dev/shm and offers it in kv_addr_info; a sender on the same host maps it, copies KV from its
pool straight into it, and sends only the chunk windows over the KVTransfer stream; the
receiver then copies each chunk from the segment into the slots its PrepRecv reserved.

Why a staging segment and not the receiver's pool itself in shared memory (as MLC's NVSHMEM
path writes straight into the receiver's pages): the pool may live on a GPU, which a /dev/shm
segment cannot hold, while a stage works for any device (device -> shm -> device, `copy_`
both ways); and the receiver keeps writing its own pool, after it checked the header's layout
and every chunk's window, so a sender reaches only the segment leased to its reservation,
never another request's KV. Two copies in all, where the gRPC stream makes about six.

One segment per reservation, sized for its whole window: no region is written twice in one
push, so the push needs no flow control and PushKV stays a one-way stream (no proto change).
A segment goes back to the free list only after a push completed (the sender writes each
chunk's region before it sends that chunk's message, so once the receiver has every chunk
nobody writes the segment any more); a reservation that ends any other way retires its
segment (unlinked, never leased again), since a sender may still be writing it. Free segments
are reused, so their pages stay faulted in on both sides, up to a byte budget.

Segments are created 0600 (same user only) with random names and a random nonce in their
first page, which a sender checks: matching host identity plus the nonce prove it mapped the
receiver's very segment. Pages are allocated up front (`posix_fallocate`): a full /dev/shm
(Docker's default is 64 MiB) fails the lease, which falls back to gRPC, instead of raising
SIGBUS in whichever process writes first. Segments are unlinked on shutdown and, should the
process be killed, by multiprocessing's resource tracker.

Mappings are never closed explicitly: tensors made with `torch.frombuffer` keep the mmap
object alive but not a buffer export, so `mmap.close()` would leave them dangling. Dropping
the last reference unmaps.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import socket
import stat
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path

import torch

from engine_shim.kv_addr import ShmOffer

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")  # where Linux's shm_open keeps its segments
HEADER_BYTES = 4096  # the nonce lives here; KV starts page-aligned after it
MIN_SEGMENT_BYTES = 1 << 20
_PREFIX = "microserving-kv-"
_NAME = re.compile(rf"{_PREFIX}[0-9]+-[0-9a-f]{{16}}")
_NONCE_BYTES = 32  # hex characters
_MAX_SENDER_MAPPINGS = 64


def host_identity() -> str | None:
    """Boot id and hostname: equal for two processes only on one running kernel under one
    hostname (containers on one host share the boot id, not the hostname). None where there
    is no /dev/shm or boot id (not Linux): no shared-memory path there."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    if not boot_id or not SHM_DIR.is_dir():
        return None
    return f"{boot_id}/{socket.gethostname()}"


def segment_names(pid: int) -> list[str]:
    """Names of the segments process `pid` created that still exist (tests, diagnostics)."""
    return sorted(p.name for p in SHM_DIR.glob(f"{_PREFIX}{pid}-*"))


# ---- receiver ----


class StagingSegment:
    """One segment the receiver created; `data` is its KV area (uint8, after the header)."""

    def __init__(self, size: int) -> None:
        self.name = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.size = size
        self.nonce = secrets.token_hex(_NONCE_BYTES // 2)
        path = SHM_DIR / self.name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        # Tracked before anything can fail, so even a killed process leaves nothing behind.
        resource_tracker.register(f"/{self.name}", "shared_memory")
        try:
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)  # MAP_SHARED
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        mapping[:_NONCE_BYTES] = self.nonce.encode()
        self.data = torch.frombuffer(mapping, dtype=torch.uint8)[HEADER_BYTES:]

    def offer(self, host: str) -> ShmOffer:
        return ShmOffer(host=host, segment=self.name, nonce=self.nonce, size=self.size)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / self.name)
        resource_tracker.unregister(f"/{self.name}", "shared_memory")


class StagingPool:
    """The receiver's segments: leased one per reservation, reused after a completed push,
    at most `max_bytes` of them alive (leased or free)."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._num_bytes = 0
        self._free: list[StagingSegment] = []
        self._leased: dict[str, StagingSegment] = {}
        self._has_warned = False

    def lease(self, num_kv_bytes: int) -> StagingSegment | None:
        """A segment for `num_kv_bytes` of KV, or None (over budget, /dev/shm full): the
        reservation is then offered gRPC only."""
        fits = [s for s in self._free if s.size - HEADER_BYTES >= num_kv_bytes]
        segment = min(fits, key=lambda s: s.size) if fits else self._create(num_kv_bytes)
        if segment is None:
            return None
        if fits:
            self._free.remove(segment)
        self._leased[segment.name] = segment
        return segment

    def _create(self, num_kv_bytes: int) -> StagingSegment | None:
        # Powers of two, so segments freed by one window size serve nearby ones.
        size = max(MIN_SEGMENT_BYTES, 1 << (num_kv_bytes + HEADER_BYTES - 1).bit_length())
        while self._free and self._num_bytes + size > self._max_bytes:
            self._retire(max(self._free, key=lambda s: s.size))
        if self._num_bytes + size > self._max_bytes:
            return None
        try:
            segment = StagingSegment(size)
        except OSError as error:
            if not self._has_warned:  # once: a full /dev/shm would otherwise log every request
                logger.warning("no shared-memory KV stage of %d bytes (%s); gRPC only", size, error)
                self._has_warned = True
            return None
        self._num_bytes += size
        return segment

    def give_back(self, segment: StagingSegment, is_clean: bool) -> None:
        """`is_clean`: a push completed into it, so no sender can still be writing it."""
        if self._leased.pop(segment.name, None) is None:
            return
        if is_clean:
            self._free.append(segment)
        else:
            self._retire(segment)

    def _retire(self, segment: StagingSegment) -> None:
        if segment in self._free:
            self._free.remove(segment)
        self._num_bytes -= segment.size
        segment.unlink()  # the memory goes once the last mapping of it is dropped

    def close(self) -> None:
        for segment in [*self._free, *self._leased.values()]:
            segment.unlink()
        self._free.clear()
        self._leased.clear()
        self._num_bytes = 0


# ---- sender ----


@dataclass
class _Mapped:
    fd: int  # kept open to see when the receiver unlinks the segment (st_nlink == 0)
    data: torch.Tensor


class SegmentMaps:
    """The sender's mappings of receivers' segments, kept while they exist, so a reused
    segment is mapped (and its pages faulted in) once."""

    def __init__(self, host: str) -> None:
        self._host = host
        self._maps: dict[str, _Mapped] = {}

    def open(self, offer: ShmOffer, num_kv_bytes: int) -> torch.Tensor | None:
        """The KV area (uint8) of the offered segment, or None when this sender cannot use
        it (another host, another /dev/shm, unknown or too small segment): push over gRPC."""
        self._drop_unlinked()
        if offer.host != self._host or not _NAME.fullmatch(offer.segment):
            return None
        if offer.size - HEADER_BYTES < num_kv_bytes:
            return None
        mapped = self._maps.get(offer.segment)
        if mapped is None:
            mapped = _map(offer)
            if mapped is None:
                return None
            if len(self._maps) >= _MAX_SENDER_MAPPINGS:
                self._drop(next(iter(self._maps)))
            self._maps[offer.segment] = mapped
        return mapped.data

    def _drop_unlinked(self) -> None:
        for name in [n for n, m in self._maps.items() if os.fstat(m.fd).st_nlink == 0]:
            self._drop(name)

    def _drop(self, name: str) -> None:
        os.close(self._maps.pop(name).fd)

    def close(self) -> None:
        for name in list(self._maps):
            self._drop(name)


def _map(offer: ShmOffer) -> _Mapped | None:
    try:
        fd = os.open(SHM_DIR / offer.segment, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        logger.info("cannot open shared-memory segment %s (%s); using gRPC", offer.segment, error)
        return None
    try:
        mapping = _checked_mapping(fd, offer)
    except BaseException:
        os.close(fd)
        raise
    if mapping is None:
        os.close(fd)
        return None
    return _Mapped(fd, torch.frombuffer(mapping, dtype=torch.uint8)[HEADER_BYTES:])


def _checked_mapping(fd: int, offer: ShmOffer) -> mmap.mmap | None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size != offer.size:
        return None
    # MAP_POPULATE faults every page in at once, far cheaper than one fault per 4 KiB.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    try:
        mapping = mmap.mmap(fd, offer.size, flags=flags)
    except OSError as error:
        logger.info("cannot map shared-memory segment %s (%s); using gRPC", offer.segment, error)
        return None
    if mapping[:_NONCE_BYTES] != offer.nonce.encode():
        return None  # a same-named segment of another /dev/shm: not the receiver's
    return mapping
