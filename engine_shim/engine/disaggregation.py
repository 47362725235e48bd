"""The engine's MicroServing state: the reservations prep_recv made on the receiving engine,
the remote_send jobs on the sending one, and the pages fenced against a peer's late write.

LLMEngine holds one `Disaggregation` over its page pool and KV cache and keeps the public
calls (prep_recv, import_kv, remote_send, export_kv, ...): it validates each call and checks
it against its own requests first, then hands the MicroServing part here. Nothing here calls
back into the engine.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .api import (
    FailedPreconditionError,
    GenerateOutput,
    InvalidRequestError,
    KVChunk,
    KVLayout,
    NotFoundError,
    PrepRecvResult,
    ResourceExhaustedError,
)
from .block_manager import BlockManager, Slots, num_pages_for, slot_segments, slots_for_positions
from .config import EngineConfig
from .kv_cache import KVCache
from .sequence import Sequence
from .weights import DTYPES

logger = logging.getLogger(__name__)

# Past a writer's declared end: data its transport still had in flight when it cancelled.
WRITE_FENCE_MARGIN_S = 1.0


@dataclass(frozen=True)
class SendReady:
    """A remote_send job's KV of [begin, end) is computed and can be exported."""

    request_id: str


@dataclass(frozen=True)
class SendFailed:
    request_id: str
    error: Exception


@dataclass(frozen=True)
class StartFailed:
    """A start that waited in the engine for its reservation's KV (kv_waits.KVWaits) failed
    without producing output: the reservation ended first, or the start failed once the KV
    was there."""

    request_id: str
    error: Exception


@dataclass(frozen=True)
class FirstTokens:
    """A send job that samples (remote_send's `first`) drew each choice's first token: its
    output as a generate request's would be (packed where the core packs outputs), and each
    choice's generator state after the draw (empty for greedy sampling), for the engine
    that continues it (start_generate's `continuations`). No output: the job ended (an abort,
    a preempt, no room) before its tokens were sampled; none will come."""

    request_id: str
    output: GenerateOutput | tuple[Any, ...] | None
    sampler_states: tuple[bytes, ...]


EngineEvent = GenerateOutput | SendReady | SendFailed | StartFailed | FirstTokens


@dataclass(eq=False)
class Reservation:
    """Pages prep_recv reserved for positions [0, end) of a prompt; [matched, end) await KV."""

    request_id: str
    token_ids: list[int]
    end: int
    prefix_matched_length: int
    block_table: list[int]
    expires_at: float
    imported: bytearray = field(default_factory=bytearray)  # 1 per position in [matched, end)
    # Set while a peer may write the pages itself (begin_kv_write): the monotonic time by
    # which its write has ended, by the bound it declared. Released pages are fenced till then.
    write_ends_at: float | None = None


@dataclass(frozen=True)
class Fence:
    """Pages of a reservation that ended while a peer may still have been writing them
    itself: free again only at `release_at`, so a late write cannot land in reused pages."""

    release_at: float
    pages: list[int]


@dataclass(eq=False)
class SendJob:
    seq: Sequence
    begin: int
    end: int
    is_ready: bool = False
    # CUDA: recorded on the engine's stream when the job became ready, after every launch
    # that wrote its pages; a transfer engine reads them once it has passed
    computed: torch.cuda.Event | None = None


class Disaggregation:
    """Reservations, send jobs and fences over the engine's page pool and KV cache."""

    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, kv_cache: KVCache, kv_layout: KVLayout
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        self.block_manager = block_manager
        self.kv_cache = kv_cache
        self.kv_layout = kv_layout
        self.reservations: dict[str, Reservation] = {}
        self.sends: dict[str, SendJob] = {}
        self.fences: list[Fence] = []

    def is_active(self, request_id: str) -> bool:
        return request_id in self.reservations or request_id in self.sends

    def next_deadline(self) -> float | None:
        """Monotonic time of the earliest finite reservation expiry (a held one has none) or
        fence end (the async loop sleeps until it)."""
        times = [r.expires_at for r in self.reservations.values() if r.expires_at != math.inf]
        times += [f.release_at for f in self.fences]
        return min(times, default=None)

    # ---- receiving: prep_recv, then KV imported or written, then start_generate ----
    def reserve(
        self, request_id: str, ids: list[int], end: int, cache_salt: str, held: bool = False
    ) -> PrepRecvResult:
        """Pages for positions [0, end) of `ids` (validated): cached prefix pages shared, the
        rest allocated to await KV. `held`: no TTL here; the caller ends it (expire). A window
        of the whole prompt (prep_recv's whole_prompt) takes at most len - 1 positions from
        the prefix cache: the sender always sends one, so there is always a transfer to wait
        for and the start never begins on a cached page it would have to write."""
        pages = self.block_manager.acquire_prefix(ids, min(end, len(ids) - 1), cache_salt)
        matched = len(pages) * self.page_size
        missing = num_pages_for(end, self.page_size) - len(pages)
        if not self.block_manager.can_allocate(missing):
            self.block_manager.release(pages)
            raise ResourceExhaustedError(f"not enough free KV pages to receive {end - matched} tokens")
        pages += self.block_manager.allocate(missing, pages[-1] if pages else None)
        self.block_manager.record_prefix_query(end, matched)
        self.reservations[request_id] = Reservation(
            request_id=request_id,
            token_ids=ids[:end],
            end=end,
            prefix_matched_length=matched,
            block_table=pages,
            expires_at=math.inf if held else time.monotonic() + self.config.reservation_ttl_s,
            imported=bytearray(end - matched),
        )
        segments = slot_segments(slots_for_positions(pages, self.page_size, matched, end))
        flat = [len(segments)] + [x for segment in segments for x in segment]
        return PrepRecvResult(request_id, end, matched, tuple(flat))

    def take_reservation(self, request_id: str, ids: list[int], begin: int) -> Reservation | None:
        """The reservation start_generate(ids, begin) continues from, removed from the table
        once it is known to cover that call; None if there is none."""
        reservation = self.reservations.get(request_id)
        if reservation is None:
            if begin != 0:
                raise FailedPreconditionError(
                    f"start_generate without prep_recv: begin={begin} needs KV that this engine lacks"
                )
            return None
        _check_covers(reservation, ids, begin)
        del self.reservations[request_id]
        return reservation

    def _reservation(self, request_id: str) -> Reservation:
        reservation = self.reservations.get(request_id)
        if reservation is None:
            raise NotFoundError(f"no prep_recv reservation for request {request_id!r}")
        return reservation

    def begin_kv_write(self, request_id: str, write_ends_at: float) -> None:
        reservation = self._reservation(request_id)
        reservation.write_ends_at = write_ends_at
        reservation.expires_at = math.inf  # held while the peer writes (as hold_reservation)

    def finish_kv_write(self, request_id: str) -> None:
        reservation = self.reservations.get(request_id)
        if reservation is None or reservation.write_ends_at is None:
            raise NotFoundError(f"no KV write in progress for request {request_id!r}")
        reservation.write_ends_at = None
        reservation.imported[:] = b"\x01" * len(reservation.imported)
        # The hold ends with the write: the TTL starts again for the start_generate to come.
        reservation.expires_at = time.monotonic() + self.config.reservation_ttl_s

    def cancel_kv_write(self, request_id: str, is_held: bool) -> None:
        reservation = self.reservations.get(request_id)
        if reservation is None or reservation.write_ends_at is None:
            raise NotFoundError(f"no KV write in progress for request {request_id!r}")
        reservation.write_ends_at = None
        ttl_s = self.config.reservation_ttl_s
        reservation.expires_at = math.inf if is_held else time.monotonic() + ttl_s

    def hold_reservation(self, request_id: str, is_held: bool) -> None:
        reservation = self._reservation(request_id)
        ttl_s = self.config.reservation_ttl_s
        reservation.expires_at = math.inf if is_held else time.monotonic() + ttl_s

    def import_kv(self, request_id: str, chunk: KVChunk) -> bool:
        """-> whether the reservation now holds every position it awaited."""
        reservation = self._reservation(request_id)
        begin, n = chunk.begin, chunk.num_tokens
        matched, end = reservation.prefix_matched_length, reservation.end
        if n < 1 or begin < matched or begin + n > end:
            raise InvalidRequestError(
                f"KV chunk [{begin}, {begin + n}) outside the reserved window [{matched}, {end})"
            )
        self.check_chunk_data(chunk.data, n)
        slots = slots_for_positions(reservation.block_table, self.page_size, begin, begin + n)
        self.kv_cache.import_slots(slots, cast(torch.Tensor, chunk.data))
        reservation.imported[begin - matched : begin - matched + n] = b"\x01" * n
        return all(reservation.imported)

    def is_filled(self, request_id: str, ids: list[int], begin: int) -> bool:
        """Whether the reservation a start_generate(ids, begin) continues from has its KV
        (FailedPreconditionError when there is none, or it cannot serve that start)."""
        reservation = self.reservations.get(request_id)
        if reservation is None:
            raise FailedPreconditionError(f"no open KV reservation for {request_id!r} to wait for")
        _check_prompt_and_window(reservation, ids, begin)
        return all(reservation.imported)

    def check_chunk_data(self, data: object, num_tokens: int) -> None:
        layout = self.kv_layout
        expected = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
        if not isinstance(data, torch.Tensor):
            raise InvalidRequestError("KV chunk data must be a tensor")
        if tuple(data.shape) != expected:
            raise InvalidRequestError(f"KV chunk shape {tuple(data.shape)}, expected {expected}")
        if data.dtype != DTYPES[self.config.dtype]:
            raise InvalidRequestError(f"KV chunk dtype {data.dtype}, expected {self.config.dtype}")

    # ---- ending reservations ----
    def release_reservation(self, request_id: str) -> bool:
        """Free (or fence, while a peer may be writing) a reservation's pages; False if none."""
        reservation = self.reservations.pop(request_id, None)
        if reservation is None:
            return False
        if reservation.write_ends_at is None:
            self.block_manager.release(reservation.block_table)
            return True
        now = time.monotonic()
        release_at = max(now, reservation.write_ends_at) + WRITE_FENCE_MARGIN_S
        logger.info(
            "reservation %s ended during a peer's write; its %d pages are fenced for %.1f s",
            reservation.request_id, len(reservation.block_table), release_at - now,
        )
        self.fences.append(Fence(release_at, reservation.block_table))
        return True

    def release_fences(self, now: float) -> None:
        ended = [f for f in self.fences if f.release_at <= now]
        for fence in ended:
            self.fences.remove(fence)
            self.block_manager.release(fence.pages)

    def expired_reservations(self, now: float) -> list[str]:
        return [r.request_id for r in self.reservations.values() if r.expires_at <= now]

    # ---- sending: remote_send computes, then the window is exported ----
    def add_send(self, seq: Sequence, begin: int, end: int) -> None:
        self.sends[seq.request_id] = SendJob(seq, begin, end)

    def mark_ready(self, request_id: str) -> None:
        job = self.sends[request_id]
        job.is_ready = True
        if self.kv_cache.kv.is_cuda:
            job.computed = torch.cuda.Event()
            job.computed.record()

    def send_is_ready(self, request_id: str) -> bool | None:
        """None without such a send; on CUDA, ready once the device has run what wrote it
        (not waited for)."""
        job = self.sends.get(request_id)
        if job is None:
            return None
        return job.is_ready and (job.computed is None or job.computed.query())

    def pop_send(self, request_id: str) -> SendJob | None:
        return self.sends.pop(request_id, None)

    def export_windows(self, request_id: str) -> list[tuple[int, int]]:
        job = self._ready_job(request_id)
        size = self.config.kv_export_chunk_tokens
        if self.config.kv_export_chunk_bytes is not None:
            size = max(1, self.config.kv_export_chunk_bytes // self.kv_cache.token_bytes)
        return [(p, min(size, job.end - p)) for p in range(job.begin, job.end, size)]

    def export_kv(self, request_id: str, begin: int, num_tokens: int, out: torch.Tensor | None) -> KVChunk:
        job = self._ready_job(request_id)
        if num_tokens < 1 or begin < job.begin or begin + num_tokens > job.end:
            raise InvalidRequestError(
                f"export window [{begin}, {begin + num_tokens}) outside [{job.begin}, {job.end})"
            )
        if out is not None:
            self.check_chunk_data(out, num_tokens)
        slots = slots_for_positions(job.seq.block_table, self.page_size, begin, begin + num_tokens)
        data = self.kv_cache.export_slots(slots, out)
        return KVChunk(begin=begin, num_tokens=num_tokens, data=data)

    def send_slots(self, request_id: str) -> Slots:
        job = self._ready_job(request_id)
        if job.computed is not None:
            # The engine wrote them asynchronously. Only the launches up to the job's own are
            # waited for, not a step launched since (a device-wide synchronize would stall the
            # core for that step's whole forward).
            job.computed.synchronize()
        return slots_for_positions(job.seq.block_table, self.page_size, job.begin, job.end)

    def _ready_job(self, request_id: str) -> SendJob:
        job = self.sends.get(request_id)
        if job is None:
            raise NotFoundError(f"no remote_send job for request {request_id!r}")
        if not job.is_ready:
            raise FailedPreconditionError(f"remote_send {request_id!r} is still computing")
        return job


def _check_prompt_and_window(reservation: Reservation, ids: list[int], begin: int) -> None:
    if ids[: reservation.end] != reservation.token_ids[: reservation.end]:
        raise FailedPreconditionError("start_generate prompt differs from the prep_recv prompt")
    if begin > reservation.end:
        raise FailedPreconditionError(f"begin={begin} is beyond the prep_recv window end={reservation.end}")


def _check_covers(reservation: Reservation, ids: list[int], begin: int) -> None:
    _check_prompt_and_window(reservation, ids, begin)
    matched = reservation.prefix_matched_length
    if begin > matched and not all(reservation.imported[: begin - matched]):
        raise FailedPreconditionError(f"KV of positions [{matched}, {begin}) has not been fully imported")
