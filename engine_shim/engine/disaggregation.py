"""The engine's MicroServing half: prep_recv / import_kv on the receiving engine and
remote_send / export_kv on the sending one, with the reservations and send jobs they keep.

`DisaggregationOps` is mixed into LLMEngine and shares its state (pages, scheduler, request
tables); generation, stepping and abort stay in llm_engine.py. Like the rest of the core, it
validates every call before it changes any state.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from . import validation
from .api import (
    AlreadyExistsError,
    FailedPreconditionError,
    GenerateOutput,
    InvalidRequestError,
    KVChunk,
    KVLayout,
    NotFoundError,
    PrepRecvResult,
    ResourceExhaustedError,
    SamplingParams,
)
from .block_manager import BlockManager, num_pages_for, slot_segments, slots_for_positions
from .config import EngineConfig
from .kv_cache import KVCache
from .scheduler import Scheduler
from .sequence import SeqKind, Sequence
from .weights import DTYPES

if TYPE_CHECKING:
    from .request import GenerateRequest

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


EngineEvent = GenerateOutput | SendReady | SendFailed


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

class DisaggregationOps:
    """prep_recv / import_kv / remote_send / export_kv over LLMEngine's pages and queues."""

    # State owned by LLMEngine.__init__, shared here.
    config: EngineConfig
    page_size: int
    block_manager: BlockManager
    kv_cache: KVCache
    scheduler: Scheduler
    max_context_length: int
    _requests: dict[str, GenerateRequest]
    _sends: dict[str, SendJob]
    _reservations: dict[str, Reservation]
    _fences: list[Fence]

    if TYPE_CHECKING:  # provided by LLMEngine

        @property
        def vocab_size(self) -> int: ...

        @property
        def kv_layout(self) -> KVLayout: ...

        def is_active(self, request_id: str) -> bool: ...

        def abort(self, request_id: str) -> bool: ...

        def step(self) -> list[EngineEvent]: ...

        def _check_fits_pool(self, num_tokens: int) -> None: ...

        def _new_seq(self, request_id: str, ids: list[int], num_prompt: int, kind: SeqKind) -> Sequence: ...

        def _drop_seq(self, seq: Sequence) -> None: ...

    def next_deadline(self) -> float | None:
        """Monotonic time of the earliest finite reservation expiry (a held one has none) or
        fence end (the async loop sleeps until it)."""
        times = [r.expires_at for r in self._reservations.values() if r.expires_at != math.inf]
        times += [f.release_at for f in self._fences]
        return min(times, default=None)

    def _check_reservation_covers(self, reservation: Reservation, ids: list[int], begin: int) -> None:
        if ids[: reservation.end] != reservation.token_ids[: reservation.end]:
            raise FailedPreconditionError("start_generate prompt differs from the prep_recv prompt")
        if begin > reservation.end:
            raise FailedPreconditionError(
                f"begin={begin} is beyond the prep_recv window end={reservation.end}"
            )
        matched = reservation.prefix_matched_length
        if begin > matched and not all(reservation.imported[: begin - matched]):
            raise FailedPreconditionError(
                f"KV of positions [{matched}, {begin}) has not been fully imported"
            )

    # ---- prep_recv / import ----
    def prep_recv(
        self,
        request_id: str,
        token_ids: SequenceT[int],
        end: int,
        sampling: SamplingParams | None = None,
    ) -> PrepRecvResult:
        request_id = validation.check_request_id(request_id)
        ids = validation.check_token_ids(token_ids, self.vocab_size)
        e = validation.check_prep_recv_end(end, len(ids))
        if sampling is not None:
            validation.check_sampling(sampling, self.vocab_size, self.max_context_length, len(ids))
        if self.is_active(request_id):
            raise AlreadyExistsError(f"request {request_id!r} is already active")
        self._check_fits_pool(len(ids) + 1)
        pages = self.block_manager.acquire_prefix(ids, e, sampling.cache_salt if sampling else "")
        matched = len(pages) * self.page_size
        missing = num_pages_for(e, self.page_size) - len(pages)
        if not self.block_manager.can_allocate(missing):
            self.block_manager.release(pages)
            raise ResourceExhaustedError(f"not enough free KV pages to receive {e - matched} tokens")
        pages += self.block_manager.allocate(missing)
        self.block_manager.record_prefix_query(e, matched)
        self._reservations[request_id] = Reservation(
            request_id=request_id,
            token_ids=ids[:e],
            end=e,
            prefix_matched_length=matched,
            block_table=pages,
            expires_at=time.monotonic() + self.config.reservation_ttl_s,
            imported=bytearray(e - matched),
        )
        segments = slot_segments(slots_for_positions(pages, self.page_size, matched, e))
        flat = [len(segments)] + [x for segment in segments for x in segment]
        return PrepRecvResult(request_id, e, matched, tuple(flat))

    def begin_kv_write(self, request_id: str, write_ends_at: float) -> None:
        """A peer is about to write [matched, end) of the reservation straight into its pages
        (a one-sided transfer-engine write) and writes nothing after `write_ends_at`
        (monotonic). Until finish_kv_write, an abort or expiry fences the pages until then
        instead of freeing them."""
        reservation = self._reservations.get(request_id)
        if reservation is None:
            raise NotFoundError(f"no prep_recv reservation for request {request_id!r}")
        reservation.write_ends_at = write_ends_at

    def finish_kv_write(self, request_id: str) -> None:
        """The peer's write landed (its notification arrived): [matched, end) is imported."""
        reservation = self._reservations.get(request_id)
        if reservation is None or reservation.write_ends_at is None:
            raise NotFoundError(f"no KV write in progress for request {request_id!r}")
        reservation.write_ends_at = None
        reservation.imported[:] = b"\x01" * len(reservation.imported)

    def _release_reservation(self, reservation: Reservation) -> None:
        if reservation.write_ends_at is None:
            self.block_manager.release(reservation.block_table)
            return
        now = time.monotonic()
        release_at = max(now, reservation.write_ends_at) + WRITE_FENCE_MARGIN_S
        logger.info(
            "reservation %s ended during a peer's write; its %d pages are fenced for %.1f s",
            reservation.request_id, len(reservation.block_table), release_at - now,
        )
        self._fences.append(Fence(release_at, reservation.block_table))

    def release_fences(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        ended = [f for f in self._fences if f.release_at <= now]
        for fence in ended:
            self._fences.remove(fence)
            self.block_manager.release(fence.pages)

    def hold_reservation(self, request_id: str, is_held: bool) -> None:
        """A KV push into the reservation has begun (held: it does not expire while the
        sender computes and streams, however long the sender's queue) or has ended (its
        TTL starts again, now, for the start_generate that should follow)."""
        reservation = self._reservations.get(request_id)
        if reservation is None:
            raise NotFoundError(f"no prep_recv reservation for request {request_id!r}")
        ttl_s = self.config.reservation_ttl_s
        reservation.expires_at = math.inf if is_held else time.monotonic() + ttl_s

    def import_kv(self, request_id: str, chunk: KVChunk) -> None:
        reservation = self._reservations.get(request_id)
        if reservation is None:
            raise NotFoundError(f"no prep_recv reservation for request {request_id!r}")
        begin, n = chunk.begin, chunk.num_tokens
        matched, end = reservation.prefix_matched_length, reservation.end
        if n < 1 or begin < matched or begin + n > end:
            raise InvalidRequestError(
                f"KV chunk [{begin}, {begin + n}) outside the reserved window [{matched}, {end})"
            )
        self._check_chunk_data(chunk.data, n)
        slots = slots_for_positions(reservation.block_table, self.page_size, begin, begin + n)
        self.kv_cache.import_slots(slots, cast(torch.Tensor, chunk.data))
        reservation.imported[begin - matched : begin - matched + n] = b"\x01" * n

    def _check_chunk_data(self, data: object, num_tokens: int) -> None:
        layout = self.kv_layout
        expected = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
        if not isinstance(data, torch.Tensor):
            raise InvalidRequestError("KV chunk data must be a tensor")
        if tuple(data.shape) != expected:
            raise InvalidRequestError(f"KV chunk shape {tuple(data.shape)}, expected {expected}")
        if data.dtype != DTYPES[self.config.dtype]:
            raise InvalidRequestError(f"KV chunk dtype {data.dtype}, expected {self.config.dtype}")

    # ---- remote_send ----
    def remote_send(
        self, request_id: str, token_ids: SequenceT[int], begin: int, end: int, cache_salt: str = ""
    ) -> None:
        """Start computing KV of prompt[:end]; a SendReady event says [begin, end) can be
        exported with export_kv; release it with abort() once exported."""
        request_id = validation.check_request_id(request_id)
        ids = validation.check_token_ids(token_ids, self.vocab_size)
        b, e = validation.check_remote_send_window(begin, end, len(ids))
        if request_id in self._sends or request_id in self._requests:
            raise AlreadyExistsError(f"request {request_id!r} is already active")
        self._check_fits_pool(e)
        seq = self._new_seq(request_id, ids[:e], e, SeqKind.SEND)
        seq.is_disaggregated = True
        seq.cache_salt = validation.check_cache_salt(cache_salt)
        self._sends[request_id] = SendJob(seq, b, e)
        self.scheduler.add(seq)

    def export_windows(self, request_id: str) -> list[tuple[int, int]]:
        """(begin, num_tokens) chunks that cover a ready job's [begin, end)."""
        job = self._ready_job(request_id)
        size = self.config.kv_export_chunk_tokens
        if self.config.kv_export_chunk_bytes is not None:
            size = max(1, self.config.kv_export_chunk_bytes // self.kv_cache.token_bytes)
        return [(p, min(size, job.end - p)) for p in range(job.begin, job.end, size)]

    def export_kv(
        self, request_id: str, begin: int, num_tokens: int, out: torch.Tensor | None = None
    ) -> KVChunk:
        """KV of [begin, begin + num_tokens): a new CPU tensor, or written into `out` (of the
        chunk's shape and the pool's dtype, on any device)."""
        job = self._ready_job(request_id)
        if num_tokens < 1 or begin < job.begin or begin + num_tokens > job.end:
            raise InvalidRequestError(
                f"export window [{begin}, {begin + num_tokens}) outside [{job.begin}, {job.end})"
            )
        if out is not None:
            self._check_chunk_data(out, num_tokens)
        slots = slots_for_positions(job.seq.block_table, self.page_size, begin, begin + num_tokens)
        data = self.kv_cache.export_slots(slots, out)
        return KVChunk(begin=begin, num_tokens=num_tokens, data=data)

    def send_slots(self, request_id: str) -> list[int]:
        """Slots of a ready job's [begin, end) in the pool, with the device's work on them
        finished: a transfer engine may read them from here until finish_remote_send."""
        job = self._ready_job(request_id)
        if self.kv_cache.kv.is_cuda:
            torch.cuda.synchronize(self.kv_cache.kv.device)  # the engine wrote them async
        return slots_for_positions(job.seq.block_table, self.page_size, job.begin, job.end)

    def finish_remote_send(self, request_id: str) -> None:
        """Release a job after its KV went out: its computed pages go to the prefix cache."""
        job = self._sends.pop(request_id, None)
        if job is not None:
            self._drop_seq(job.seq)

    def _ready_job(self, request_id: str) -> SendJob:
        job = self._sends.get(request_id)
        if job is None:
            raise NotFoundError(f"no remote_send job for request {request_id!r}")
        if not job.is_ready:
            raise FailedPreconditionError(f"remote_send {request_id!r} is still computing")
        return job

    def reap_expired_reservations(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        if self._fences:
            self.release_fences(now)
        expired = [r.request_id for r in self._reservations.values() if r.expires_at <= now]
        for request_id in expired:
            logger.info("prep_recv reservation %s expired unused; reclaiming", request_id)
            self.abort(request_id)
        return expired

    def run_remote_send(
        self, request_id: str, token_ids: SequenceT[int], begin: int, end: int
    ) -> list[KVChunk]:
        """remote_send + step until ready + export every chunk + release (other requests in
        the engine advance too)."""
        self.remote_send(request_id, token_ids, begin, end)
        while not self._sends[request_id].is_ready:
            failed = [e for e in self.step() if isinstance(e, SendFailed) and e.request_id == request_id]
            if failed:
                raise failed[0].error
        chunks = [self.export_kv(request_id, b, n) for b, n in self.export_windows(request_id)]
        self.finish_remote_send(request_id)
        return chunks
