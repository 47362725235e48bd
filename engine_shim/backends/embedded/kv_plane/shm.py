"""Same-host KV through shared memory. A receiver leases each reservation a staging segment and
offers it in kv_addr_info; a sender on the same host maps it, copies KV from its pool
straight into it, and sends only the chunk windows over the KVTransfer stream; the receiver
then copies each chunk from the segment into the slots its PrepRecv reserved.

Why a staging segment and not the receiver's pool itself in shared memory (as MLC's NVSHMEM
path writes straight into the receiver's pages): the pool may live on a GPU, which shared
memory cannot hold, while a stage works for any device (device -> shm -> device, `copy_`
both ways); and the receiver keeps writing its own pool, after it checked the header's layout
and every chunk's window, so a sender reaches only the segment leased to its reservation,
never another request's KV. Two copies in all, where the gRPC stream makes about six.

One segment per reservation, sized for its whole window: no region is written twice in one
push, so the push needs no flow control and PushKV stays a one-way stream (no proto change).
A segment goes back to the free list only after a push completed (the sender writes each
chunk's region before it sends that chunk's message, so once the receiver has every chunk
nobody writes the segment any more); a reservation that ends any other way retires its
segment (closed, never leased again), since a sender may still be writing it. Free segments
are reused, so their pages stay faulted in on both sides, up to a byte budget.

Segments are memfds (anonymous shared memory with no name in /dev/shm): the kernel frees one
once its last descriptor and mapping are gone, so nothing outlives the processes using it,
however they end (a named /dev/shm segment outlives a SIGKILL of its creator and its
cleanup helper alike). A sender opens one as /proc/<receiver pid>/fd/<fd>, which works only
in the receiver's pid namespace and with ptrace-read access to it (same user): anywhere else
the open fails and the push goes over gRPC. A random nonce in the first page proves the
sender mapped the receiver's very segment (a reused pid or fd number fails it). Pages are
allocated up front (`posix_fallocate`), so a lack of memory fails the lease (gRPC then)
instead of raising SIGBUS in whichever process writes first; except for a reservation that
also offers a NIXL write, which a NIXL sender never stages: its segment is leased unbacked
(a sender without NIXL faults its pages in as it writes), since backing it would zero
megabytes in PrepRecv's path (8 MiB for 255 tokens of llama-1b) and keep a decode shim's
whole stage budget committed for nothing. An unbacked segment is backed when a later lease
needs it backed.

Mappings are never closed explicitly: tensors made with `torch.frombuffer` keep the mmap
object alive but not a buffer export, so `mmap.close()` would leave them dangling. Dropping
the last reference unmaps.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import secrets
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_shim.backends.embedded.kv_plane.addr import ShmOffer
from engine_shim.backends.embedded.kv_plane.codec import staged_chunk
from engine_shim.engine.api import KVLayout, UnavailableError

logger = logging.getLogger(__name__)

HEADER_BYTES = 4096  # the nonce lives here; KV starts page-aligned after it
_MIN_KV_BYTES = 1 << 20
MIN_SEGMENT_BYTES = HEADER_BYTES + _MIN_KV_BYTES
MEMFD_NAME = "microserving-kv"  # shows as /memfd:microserving-kv in /proc/<pid>/fd
_NONCE_BYTES = 32  # hex characters
# A sender keeps this many receivers' segments mapped, least recently used out first. It must
# cover the segments that rotate through the reservations in flight: at 64 bounded below
# that, every push at 64 streams mapped (and faulted in) its segment anew, 14% of the prefill
# shim's samples in the capacity bench. A mapping costs page tables, not memory.
_MAX_SENDER_MAPPINGS = 1024
# How often the mappings of segments their receiver closed are looked for (a stat each).
RETIRED_CHECK_S = 1.0


def host_identity() -> str | None:
    """Boot id and hostname: equal for two processes only on one running kernel under one
    hostname (containers on one host share the boot id, not the hostname). None where there
    are no memfds or no boot id (not Linux): no shared-memory path there."""
    if not hasattr(os, "memfd_create"):
        return None
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    return f"{boot_id}/{socket.gethostname()}" if boot_id else None


def stage_fds(pid: int) -> list[int]:
    """Descriptors of the stages process `pid` holds open (tests, diagnostics)."""
    fds = []
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(entry).startswith(f"/memfd:{MEMFD_NAME}"):
                fds.append(int(entry.name))
        except OSError:
            continue  # closed meanwhile
    return sorted(fds)


# ---- receiver ----


class StagingSegment:
    """One segment the receiver created; `data` is its KV area (uint8, after the header)."""

    def __init__(self, size: int, backed: bool = True) -> None:
        self.size = size
        self.nonce = secrets.token_hex(_NONCE_BYTES // 2)
        self.fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        self.is_backed = False
        try:
            os.ftruncate(self.fd, size)
            if backed:
                self.back()
            mapping = mmap.mmap(self.fd, size)  # MAP_SHARED
        except BaseException:
            os.close(self.fd)
            raise
        mapping[:_NONCE_BYTES] = self.nonce.encode()
        self.data = torch.frombuffer(mapping, dtype=torch.uint8)[HEADER_BYTES:]

    def back(self) -> None:
        """Allocate every page now (OSError where memory lacks), not at a sender's write."""
        if not self.is_backed:
            os.posix_fallocate(self.fd, 0, self.size)
            self.is_backed = True

    def offer(self, host: str) -> ShmOffer:
        return ShmOffer(host=host, pid=os.getpid(), fd=self.fd, nonce=self.nonce, size=self.size)

    def close(self) -> None:
        """No sender can open it any more; the memory goes with the last mapping of it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class StagingPool:
    """The receiver's segments: leased one per reservation, reused after a completed push,
    at most `max_bytes` of them alive (leased or free)."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._num_bytes = 0
        self._free: list[StagingSegment] = []
        self._leased: dict[int, StagingSegment] = {}  # by fd
        self._has_warned = False

    def lease(self, num_kv_bytes: int, backed: bool = True) -> StagingSegment | None:
        """A segment for `num_kv_bytes` of KV, or None (over budget, no memory): the
        reservation is then offered gRPC only. `backed` False: its pages need not be
        allocated up front (the reservation offers NIXL too, module docstring)."""
        fits = [s for s in self._free if s.size - HEADER_BYTES >= num_kv_bytes]
        if fits:
            segment = min(fits, key=lambda s: s.size)
            if backed and not self._back(segment):
                return None
            self._free.remove(segment)
        else:
            created = self._create(num_kv_bytes, backed)
            if created is None:
                return None
            segment = created
        self._leased[segment.fd] = segment
        return segment

    def _back(self, segment: StagingSegment) -> bool:
        try:
            segment.back()
        except OSError as error:
            self._warn_once(segment.size, error)
            return False
        return True

    def _warn_once(self, size: int, error: OSError) -> None:
        if not self._has_warned:  # once: a lack of memory would otherwise log every request
            logger.warning("no shared-memory KV stage of %d bytes (%s); gRPC only", size, error)
            self._has_warned = True

    def _create(self, num_kv_bytes: int, backed: bool) -> StagingSegment | None:
        # KV areas in powers of two, so segments freed by one window size serve nearby ones;
        # the header page beside them, not inside (a window of a power of two, e.g. 256
        # tokens of llama-1b in 8 MiB, would otherwise take a segment twice its size).
        size = HEADER_BYTES + max(_MIN_KV_BYTES, 1 << (num_kv_bytes - 1).bit_length())
        while self._free and self._num_bytes + size > self._max_bytes:
            self._retire(max(self._free, key=lambda s: s.size))
        if self._num_bytes + size > self._max_bytes:
            return None
        try:
            segment = StagingSegment(size, backed)
        except OSError as error:
            self._warn_once(size, error)
            return None
        self._num_bytes += size
        return segment

    def give_back(self, segment: StagingSegment, is_clean: bool) -> None:
        """`is_clean`: a push completed into it, so no sender can still be writing it."""
        if self._leased.pop(segment.fd, None) is None:
            return
        if is_clean:
            self._free.append(segment)
        else:
            self._retire(segment)

    def _retire(self, segment: StagingSegment) -> None:
        if segment in self._free:
            self._free.remove(segment)
        self._num_bytes -= segment.size
        segment.close()

    def close(self) -> None:
        for segment in [*self._free, *self._leased.values()]:
            segment.close()
        self._free.clear()
        self._leased.clear()
        self._num_bytes = 0


# ---- sender ----


@dataclass
class _Mapped:
    fd: int  # this process's descriptor of the segment
    inode: int  # to tell, through /proc, whether the receiver still holds this very segment
    data: torch.Tensor


class SegmentMaps:
    """The sender's mappings of receivers' segments, kept while the receiver holds them, so
    a reused segment is mapped (and its pages faulted in) once."""

    def __init__(self, host: str) -> None:
        self._host = host
        # by (pid, fd, nonce), least recently used first
        self._maps: dict[tuple[int, int, str], _Mapped] = {}
        self._checked_at = time.monotonic()

    def open(self, offer: ShmOffer, num_kv_bytes: int) -> torch.Tensor | None:
        """The KV area (uint8) of the offered segment, or None when this sender cannot use
        it (another host, another pid namespace or user, a retired or too small segment):
        push over gRPC."""
        if time.monotonic() - self._checked_at >= RETIRED_CHECK_S:
            self._drop_retired()
        if offer.host != self._host or offer.size - HEADER_BYTES < num_kv_bytes:
            return None
        key = (offer.pid, offer.fd, offer.nonce)
        mapped = self._maps.get(key)
        if mapped is not None and not _is_held(key, mapped):
            self._drop(key)  # its receiver closed it
            return None
        if mapped is not None:
            self._maps[key] = self._maps.pop(key)  # now the most recently used
        else:
            mapped = _map(offer)
            if mapped is None:
                return None
            if len(self._maps) >= _MAX_SENDER_MAPPINGS:
                self._drop(next(iter(self._maps)))
            self._maps[key] = mapped
        return mapped.data

    def _drop_retired(self) -> None:
        """Mappings of segments their receiver closed (or that died) hold memory: drop them."""
        self._checked_at = time.monotonic()
        for key, mapped in list(self._maps.items()):
            if not _is_held(key, mapped):
                self._drop(key)

    def _drop(self, key: tuple[int, int, str]) -> None:
        os.close(self._maps.pop(key).fd)

    def close(self) -> None:
        for key in list(self._maps):
            self._drop(key)


def _is_held(key: tuple[int, int, str], mapped: _Mapped) -> bool:
    """Whether the receiver still holds the segment at that descriptor."""
    pid, fd, _ = key
    try:
        return os.stat(f"/proc/{pid}/fd/{fd}").st_ino == mapped.inode
    except OSError:
        return False


def _map(offer: ShmOffer) -> _Mapped | None:
    path = f"/proc/{offer.pid}/fd/{offer.fd}"
    try:
        if not os.readlink(path).startswith(f"/memfd:{MEMFD_NAME}"):
            return None  # that descriptor is something else now
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as error:
        logger.info("cannot open shared-memory segment %s (%s); using gRPC", path, error)
        return None
    try:
        mapping = _checked_mapping(fd, offer)
    except BaseException:
        os.close(fd)
        raise
    if mapping is None:
        os.close(fd)
        return None
    data = torch.frombuffer(mapping, dtype=torch.uint8)[HEADER_BYTES:]
    return _Mapped(fd, os.fstat(fd).st_ino, data)


def _checked_mapping(fd: int, offer: ShmOffer) -> mmap.mmap | None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size != offer.size:
        return None
    # MAP_POPULATE faults every page in at once, far cheaper than one fault per 4 KiB.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    try:
        mapping = mmap.mmap(fd, offer.size, flags=flags)
    except OSError as error:
        logger.info("cannot map shared-memory segment of %d (%s); using gRPC", offer.pid, error)
        return None
    if mapping[:_NONCE_BYTES] != offer.nonce.encode():
        return None  # another segment (a reused pid or descriptor number)
    return mapping


# An engine core in a process of its own maps offered segments itself (StageWindow).
_process_segments: SegmentMaps | None = None


class StageWindow:
    """Where a send's chunks go in a receiver's stage: `window(begin, num_tokens)` is the view
    a chunk is exported into. It pickles without its mapping, so an engine core running in a
    process of its own writes the stage directly (mapping the segment there, once) instead of
    sending each chunk back through its pipe."""

    def __init__(
        self, offer: ShmOffer, num_kv_bytes: int, window_begin: int, layout: KVLayout,
        stage: torch.Tensor | None = None,
    ) -> None:
        self.offer = offer
        self.num_kv_bytes = num_kv_bytes
        self.window_begin = window_begin
        self.layout = layout
        self._stage = stage  # this process's mapping, when it has one

    def __call__(self, begin: int, num_tokens: int) -> torch.Tensor:
        if self._stage is None:
            self._stage = _map_here(self.offer, self.num_kv_bytes)
        return staged_chunk(self._stage, self.window_begin, begin, num_tokens, layout=self.layout)

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_stage": None}


def _map_here(offer: ShmOffer, num_kv_bytes: int) -> torch.Tensor:
    global _process_segments
    if _process_segments is None:
        _process_segments = SegmentMaps(offer.host)
    stage = _process_segments.open(offer, num_kv_bytes)
    if stage is None:
        raise UnavailableError("the receiver's shared-memory stage is gone")
    return stage


class StagedSlice:
    """A received chunk's KV by reference to its window of the receiver's own stage: calling
    it gives the view. It pickles without the mapping, so an engine core in a process of its
    own imports straight from the stage instead of the chunk's bytes crossing its pipe."""

    def __init__(self, window: StageWindow, begin: int, num_tokens: int) -> None:
        self.window = window
        self.begin = begin
        self.num_tokens = num_tokens

    def __call__(self) -> torch.Tensor:
        return self.window(self.begin, self.num_tokens)


def staged_slice(segment: StagingSegment, window_begin: int, begin: int, num_tokens: int,
                 layout: KVLayout) -> StagedSlice:
    """[begin, begin + num_tokens) of a receiver's own stage, by reference."""
    offer = segment.offer(_this_host())
    window = StageWindow(offer, int(segment.data.numel()), window_begin, layout, segment.data)
    staged_chunk(segment.data, window_begin, begin, num_tokens, layout)  # checks the bounds here
    return StagedSlice(window, begin, num_tokens)


@functools.cache
def _this_host() -> str:
    return host_identity() or ""
