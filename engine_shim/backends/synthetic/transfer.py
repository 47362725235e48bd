"""BENCHMARK ONLY. The synthetic engine's MicroServing half, mixed into SyntheticCore like
DisaggregationOps into LLMEngine: prep_recv reserves fake pages, import_kv checks and records
the tiny KV chunks the real data plane delivers, remote_send computes (on the schedule) the
prompt window and exports chunks whose values are their positions, so a receiver can check
that the transfer delivered exactly its window."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from engine_shim.backends.synthetic.pages import PagePool
from engine_shim.backends.synthetic.tokens import refuse_unmodelled
from engine_shim.engine import validation
from engine_shim.engine.api import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidRequestError,
    KVChunk,
    NotFoundError,
    PackedOutput,
    PrepRecvResult,
    RequestAbortedError,
    ResourceExhaustedError,
    SamplingParams,
)
from engine_shim.engine.config import EngineConfig
from engine_shim.engine.disaggregation import EngineEvent, FirstTokens, SendFailed
from engine_shim.engine.kv_waits import KVWaits
from engine_shim.engine.sequence import SeqKind, Sequence

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_KV_BYTES_PER_TOKEN = 8  # the synthetic layout: 1 layer x (key, value) x 1 head x 1 float32


@dataclass(eq=False)
class SyntheticReservation:
    token_ids: list[int]
    end: int
    pages: list[int]
    expires_at: float
    imported: bytearray = field(default_factory=bytearray)  # 1 per position in [0, end)


@dataclass(eq=False)
class SyntheticSendJob:
    seq: Sequence
    begin: int
    end: int
    is_ready: bool = False


class TransferOps:
    """prep_recv / import_kv / remote_send / export_kv over SyntheticCore's page count."""

    config: EngineConfig
    vocab_size: int
    max_context_length: int
    pages: PagePool
    _waiting: Any  # deque[Sequence], owned by SyntheticCore
    _events: list[EngineEvent | PackedOutput]
    _requests: dict[str, Any]  # request id -> GenerateRequest, owned by SyntheticCore

    if TYPE_CHECKING:  # provided by SyntheticCore

        def is_active(self, request_id: str) -> bool: ...

        def abort(self, request_id: str) -> bool: ...

        def _drop_seq(self, seq: Sequence) -> None: ...

        def _new_seq(self, request_id: str, ids: list[int], kind: SeqKind) -> Sequence: ...

        def _first_request(self, request_id: str, ids: list[int], sampling: SamplingParams, max_tokens: int) -> Any: ...

    def __init__(self) -> None:
        self._sends: dict[str, SyntheticSendJob] = {}
        self._reservations: dict[str, SyntheticReservation] = {}
        self._kv_waits = KVWaits(lambda event: self._events.append(event))  # as LLMEngine's: starts waiting for their KV
        # send jobs that draw their request's first tokens (remote_send's `first`)
        self._first_samples: dict[str, tuple[Sequence, Any]] = {}

    # ---- receiving ----
    def prep_recv(
        self, request_id: str, token_ids: SequenceT[int], end: int,
        sampling: SamplingParams | None = None, held: bool = False, whole_prompt: bool = False,
    ) -> PrepRecvResult:
        request_id = validation.check_request_id(request_id)
        ids = validation.check_token_ids(token_ids, self.vocab_size)
        e = validation.check_prep_recv_end(end, len(ids), whole_prompt)
        if sampling is not None:
            validation.check_sampling(sampling, self.vocab_size, self.max_context_length, len(ids))
        if self.is_active(request_id):
            raise AlreadyExistsError(f"request {request_id!r} is already active")
        self.pages.check_fits(len(ids) + 1)
        pages: list[int] = []
        if not self.pages.grow(pages, e):
            raise ResourceExhaustedError(f"not enough free KV pages to receive {e} tokens")
        self._reservations[request_id] = SyntheticReservation(
            token_ids=ids[:e], end=e, pages=pages,
            expires_at=math.inf if held else time.monotonic() + self.config.reservation_ttl_s,
            imported=bytearray(e),
        )
        # No prefix cache: every position is received. One segment of made-up slots.
        return PrepRecvResult(request_id, e, 0, (1, 0, e) if e else (0,))

    def import_kv(self, request_id: str, chunk: KVChunk) -> None:
        reservation = self._reservations.get(request_id)
        if reservation is None:
            raise NotFoundError(f"no prep_recv reservation for request {request_id!r}")
        begin, n = chunk.begin, chunk.num_tokens
        if n < 1 or begin < 0 or begin + n > reservation.end:
            raise InvalidRequestError(
                f"KV chunk [{begin}, {begin + n}) outside the reserved window [0, {reservation.end})"
            )
        _check_positions(chunk.data, begin, n)
        reservation.imported[begin : begin + n] = b"\x01" * n
        if all(reservation.imported):
            self._kv_waits.filled(request_id, self.abort)

    def _kv_is_filled(self, request_id: str, ids: list[int], begin: int) -> bool:
        """As Disaggregation.is_filled: whether the reservation a start continues from has
        its KV (FailedPreconditionError when there is none, or it cannot serve the start)."""
        reservation = self._reservations.get(request_id)
        if reservation is None:
            raise FailedPreconditionError(f"no open KV reservation for {request_id!r} to wait for")
        _check_prompt_and_window(reservation, ids, begin)
        return all(reservation.imported)

    def _check_reservation_covers(
        self, reservation: SyntheticReservation, ids: list[int], begin: int
    ) -> None:
        _check_prompt_and_window(reservation, ids, begin)
        if not all(reservation.imported[:begin]):
            raise FailedPreconditionError(f"KV of positions [0, {begin}) has not been fully imported")

    def expire_reservation(self, request_id: str) -> bool:
        """As the real engine: a held reservation's owner ended it."""
        self._kv_waits.ended(request_id)
        return self._release_reservation(request_id)

    def _release_reservation(self, request_id: str) -> bool:
        reservation = self._reservations.pop(request_id, None)
        if reservation is None:
            return False
        self.pages.release(reservation.pages)
        return True

    def hold_reservation(self, request_id: str, is_held: bool) -> None:
        """As the real engine: no expiry while a push into it is open (disaggregation.py)."""
        reservation = self._reservations.get(request_id)
        if reservation is None:
            raise NotFoundError(f"no prep_recv reservation for request {request_id!r}")
        reservation.expires_at = (
            math.inf if is_held else time.monotonic() + self.config.reservation_ttl_s)

    def next_deadline(self) -> float | None:
        deadline = min((r.expires_at for r in self._reservations.values()), default=None)
        return None if deadline == math.inf else deadline

    def reap_expired_reservations(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        expired = [rid for rid, r in self._reservations.items() if r.expires_at <= now]
        for request_id in expired:
            logger.info("prep_recv reservation %s expired unused; reclaiming", request_id)
            self.abort(request_id)
        return expired

    # ---- sending ----
    def remote_send(
        self, request_id: str, token_ids: SequenceT[int], begin: int, end: int, cache_salt: str = "",
        first: SamplingParams | None = None,
    ) -> None:
        """Queue the prompt window's "computation" (prefill time on the schedule); a
        SendReady event says [begin, end) can be exported. No prefix cache here, so the
        cache salt scopes nothing. `first`: as LLMEngine's, the whole prompt is "computed"
        and each choice's first token drawn once it is (a FirstTokens event)."""
        del cache_salt
        request_id = validation.check_request_id(request_id)
        ids = validation.check_token_ids(token_ids, self.vocab_size)
        b, e = validation.check_remote_send_window(begin, end, len(ids), samples_first=first is not None)
        max_tokens = 0
        if first is not None:
            max_tokens = validation.check_sampling(first, self.vocab_size, self.max_context_length, len(ids))
            refuse_unmodelled(first)
        # A reservation of the same id may coexist (one engine both sending and receiving).
        if request_id in self._sends or request_id in self._requests:
            raise AlreadyExistsError(f"request {request_id!r} is already active")
        computed = e if first is None else len(ids)
        self.pages.check_fits(computed)
        seq = self._new_seq(request_id, ids[:computed], SeqKind.SEND)
        seq.is_disaggregated = True
        if first is not None:
            seq.samples_last = True
            self._first_samples[request_id] = (seq, self._first_request(request_id, ids, first, max_tokens))
        self._sends[request_id] = SyntheticSendJob(seq, b, e)
        self._waiting.append(seq)

    def export_windows(self, request_id: str) -> list[tuple[int, int]]:
        job = self._ready_job(request_id)
        size = self.config.kv_export_chunk_tokens
        if self.config.kv_export_chunk_bytes is not None:
            size = max(1, self.config.kv_export_chunk_bytes // _KV_BYTES_PER_TOKEN)
        return [(p, min(size, job.end - p)) for p in range(job.begin, job.end, size)]

    def export_kv(
        self, request_id: str, begin: int, num_tokens: int, out: torch.Tensor | None = None
    ) -> KVChunk:
        job = self._ready_job(request_id)
        if num_tokens < 1 or begin < job.begin or begin + num_tokens > job.end:
            raise InvalidRequestError(
                f"export window [{begin}, {begin + num_tokens}) outside [{job.begin}, {job.end})"
            )
        chunk = position_stamped_chunk(begin, num_tokens)
        if out is None:
            return chunk
        out.copy_(cast("torch.Tensor", chunk.data))
        return KVChunk(begin, num_tokens, out)

    def finish_remote_send(self, request_id: str) -> None:
        job = self._sends.pop(request_id, None)
        if job is not None:
            self._drop_seq(job.seq)

    def _ready_job(self, request_id: str) -> SyntheticSendJob:
        job = self._sends.get(request_id)
        if job is None:
            raise NotFoundError(f"no remote_send job for request {request_id!r}")
        if not job.is_ready:
            raise FailedPreconditionError(f"remote_send {request_id!r} is still computing")
        return job

    def _abort_transfer(self, request_id: str) -> bool:
        if self._first_samples.pop(request_id, None) is not None:
            self._events.append(FirstTokens(request_id, None, ()))
        found = False
        job = self._sends.pop(request_id, None)
        if job is not None:
            found = True
            self._drop_seq(job.seq)
            self._events.append(SendFailed(request_id, RequestAbortedError(f"{request_id!r} aborted")))
        self._kv_waits.ended(request_id)
        return self._release_reservation(request_id) or found


def _check_prompt_and_window(reservation: SyntheticReservation, ids: list[int], begin: int) -> None:
    """A start of `ids` from `begin` can continue from the reservation (its KV aside)."""
    if ids[: reservation.end] != reservation.token_ids:
        raise FailedPreconditionError("start_generate prompt differs from the prep_recv prompt")
    if begin > reservation.end:
        raise FailedPreconditionError(f"begin={begin} is beyond the prep_recv window end={reservation.end}")


def position_stamped_chunk(begin: int, num_tokens: int) -> KVChunk:
    """Synthetic KV of [begin, begin + num_tokens): each position's key and value hold it."""
    import torch

    positions = torch.arange(begin, begin + num_tokens, dtype=torch.float32)
    data = positions.view(1, 1, num_tokens, 1, 1).expand(1, 2, num_tokens, 1, 1).contiguous()
    return KVChunk(begin, num_tokens, data)


def _check_positions(data: object, begin: int, num_tokens: int) -> None:
    """A synthetic chunk holds its positions: anything else was delivered to the wrong place."""
    import torch

    expected = (1, 2, num_tokens, 1, 1)
    if not isinstance(data, torch.Tensor) or tuple(data.shape) != expected:
        raise InvalidRequestError(f"synthetic KV chunk must be a tensor of shape {expected}")
    first, last = float(data[0, 0, 0]), float(data[0, 1, -1])
    if first != begin or last != begin + num_tokens - 1:
        raise InvalidRequestError(
            f"synthetic KV chunk holds positions {first:g}..{last:g}, not "
            f"{begin}..{begin + num_tokens - 1}"
        )
