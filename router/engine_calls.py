"""The three MicroServing calls at the wire level: engine protos in, engine protos out, with
the router's bookkeeping around each (engines touched for the Abort fan-out, KV reservations,
in-flight counts per stage, stage deadlines, a failing engine taken out of rotation).

The built-in patterns call these directly, so their tokens go from the engine's stream to
the client's with no per-token object in between; the MLC-named helpers of the programmable
API (`Router.send_prepare_receive` / `send_remote_send` / `send_start_generate`) convert their
pydantic requests and call the same functions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from microserving import tracing
from microserving.transport import FAULT_METADATA_KEY, FAULT_RECEIVER
from microserving.v1 import common_pb2, engine_pb2
from router.endpoint import (
    STAGE_DECODE,
    STAGE_PREP_RECV,
    STAGE_REMOTE_SEND,
    STAGE_RESERVED,
    Endpoint,
)
from router.engine_stream import StreamedDecode
from router.metrics import RouterMetrics
from router.policies import normalise_end

if TYPE_CHECKING:
    from router.router import Router

# A decode step as a pattern hands it back: a StartGenerate stream's messages, or a request
# on the engine's multiplexed stream.
Messages = AsyncGenerator[engine_pb2.StartGenerateResponse, None]
Decode = Messages | StreamedDecode[Any]


@dataclass(frozen=True)
class EngineJob:
    """One attempt of a request as the engines see it: the id every call carries, the prompt
    as token ids (a resume appends the tokens already streamed) and the sampling values."""

    request_id: str
    token_ids: list[int]
    sampling: common_pb2.SamplingParams


async def prep_recv(router: Router, endpoint: Endpoint, job: EngineJob, end: int) -> tuple[bytes, int]:
    """PrepRecv on the receiver -> (kv_addr_info, prefix_matched_length); the reservation is
    counted on the engine until start_generate claims it or the attempt closes."""
    ctx = router.context(job.request_id)
    ctx.touch(endpoint.address)
    message = engine_pb2.PrepRecvRequest(
        request_id=job.request_id, token_ids=job.token_ids, end=end, sampling=job.sampling
    )
    started_s = time.perf_counter()
    try:
        with endpoint.track(STAGE_PREP_RECV), _span("prep_recv", endpoint, job, ctx.traceparent) as span:
            reply = await endpoint.stub.PrepRecv(message, timeout=router.settings.prep_recv_timeout_s,
                                                 metadata=tracing.metadata(span.traceparent))
    except grpc.aio.AioRpcError as exc:
        raise router.call_failed(exc, endpoint.address, "prep_recv") from exc
    router.metrics.engine_call_s.labels(endpoint.address, "prep_recv").observe(time.perf_counter() - started_s)
    if endpoint.address not in ctx.reservations:
        ctx.reservations.add(endpoint.address)
        endpoint.acquire(STAGE_RESERVED)
    return reply.kv_addr_info, reply.prefix_matched_length


async def remote_send(
    router: Router, endpoint: Endpoint, job: EngineJob, *, begin: int, end: int, kv_addr_info: bytes,
    recv_rank: int, receiver: str | None = None,
) -> None:
    """RemoteSend on the sender; returns once the KV reached the receiver. When the sender
    says the receiver failed (trailing metadata), the error names `receiver` (if known)."""
    ctx = router.context(job.request_id)
    ctx.touch(endpoint.address)
    message = engine_pb2.RemoteSendRequest(
        request_id=job.request_id, token_ids=job.token_ids, begin=begin, end=end,
        kv_addr_info=kv_addr_info, recv_rank=recv_rank, sampling=job.sampling,
    )
    started_s = time.perf_counter()
    try:
        with endpoint.track(STAGE_REMOTE_SEND), _span("remote_send", endpoint, job, ctx.traceparent) as span:
            await endpoint.stub.RemoteSend(message, timeout=router.settings.remote_send_timeout_s,
                                           metadata=tracing.metadata(span.traceparent))
    except grpc.aio.AioRpcError as exc:
        at_fault = receiver if receiver is not None and _blames_receiver(exc) else endpoint.address
        raise router.call_failed(exc, at_fault, "remote_send") from exc
    num_tokens = normalise_end(end, len(job.token_ids)) - begin
    observe_remote_send(router.metrics, endpoint, num_tokens, time.perf_counter() - started_s)


def _blames_receiver(exc: grpc.aio.AioRpcError) -> bool:
    trailing = exc.trailing_metadata() or ()
    return any(key == FAULT_METADATA_KEY and value == FAULT_RECEIVER for key, value in trailing)


def _span(call: str, endpoint: Endpoint, job: EngineJob, traceparent: str) -> tracing.Span:
    return tracing.Span(f"router.{call}", traceparent, {
        "microserving.engine": endpoint.address, "microserving.engine_request_id": job.request_id})


# Bytes of one element of a KV dtype an engine reports.
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def observe_remote_send(metrics: RouterMetrics, sender: Endpoint, num_tokens: int, elapsed_s: float) -> None:
    """A RemoteSend's duration and the KV it moved: tokens x the sender's KV bytes per token
    (2 x layers x KV heads x head size x dtype bytes, from its last status)."""
    address = sender.address
    metrics.engine_call_s.labels(address, "remote_send").observe(elapsed_s)
    if num_tokens <= 0:
        return
    metrics.kv_transfer_tokens.labels(address).inc(num_tokens)
    layout = sender.status.kv_layout if sender.status is not None else None
    element_bytes = _DTYPE_BYTES.get(layout.dtype, 0) if layout is not None else 0
    if layout is None or not element_bytes:
        return  # e.g. an MLC engine, which does not report its layout
    num_bytes = num_tokens * 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * element_bytes
    metrics.kv_transfer_bytes.labels(address).inc(num_bytes)
    if elapsed_s > 0:
        metrics.kv_transfer_rate.labels(address).observe(num_bytes / elapsed_s)


def decode(router: Router, endpoint: Endpoint, job: EngineJob, begin: int) -> Decode:
    """The decode step of a pattern, not yet started: on the engine's multiplexed stream when
    the request's context asks for it (the runner's fast path), else a StartGenerate call."""
    ctx = router.context(job.request_id)
    stream = router.engine_stream(endpoint)
    if not ctx.use_engine_stream or not stream.is_supported:
        return start_generate(router, endpoint, job, begin)
    ctx.touch(endpoint.address)
    if endpoint.address in ctx.reservations:  # the start claims the reservation
        ctx.reservations.discard(endpoint.address)
        endpoint.release(STAGE_RESERVED)
    message = engine_pb2.StartGenerateRequest(
        request_id=job.request_id, token_ids=job.token_ids, begin=begin, sampling=job.sampling,
        traceparent=ctx.traceparent,
    )
    return StreamedDecode(router, endpoint, stream, message)


async def start_generate(
    router: Router, endpoint: Endpoint, job: EngineJob, begin: int
) -> AsyncGenerator[engine_pb2.StartGenerateResponse, None]:
    """StartGenerate on the receiver: its stream messages as they come, under the first-token
    and inter-token deadlines. Closing the iterator early cancels the engine call."""
    ctx = router.context(job.request_id)
    ctx.touch(endpoint.address)
    if endpoint.address in ctx.reservations:
        ctx.reservations.discard(endpoint.address)
        endpoint.release(STAGE_RESERVED)
    message = engine_pb2.StartGenerateRequest(
        request_id=job.request_id, token_ids=job.token_ids, begin=begin, sampling=job.sampling,
        traceparent=ctx.traceparent,
    )
    endpoint.acquire(STAGE_DECODE)
    call = endpoint.stub.StartGenerate(message)
    settings = router.settings
    watchdog = ReadWatchdog(call, settings.first_token_timeout_s)
    try:
        while True:
            watchdog.reading()
            try:
                reply = await call.read()
            except asyncio.CancelledError:
                if watchdog.has_expired and _is_not_cancelled():
                    raise router.call_failed(TimeoutError(), endpoint.address, "start_generate") from None
                raise
            except grpc.aio.AioRpcError as exc:
                failure = TimeoutError() if watchdog.has_expired else exc  # ended by the watchdog's cancel
                raise router.call_failed(failure, endpoint.address, "start_generate") from exc
            watchdog.idle(settings.inter_token_timeout_s)
            if reply is grpc.aio.EOF:
                return
            yield reply
    finally:
        watchdog.stop()
        endpoint.release(STAGE_DECODE)
        call.cancel()  # no-op after a clean end; aborts the engine request otherwise


def _is_not_cancelled() -> bool:
    task = asyncio.current_task()
    return task is None or not task.cancelling()


class ReadWatchdog:
    """A deadline on each read of a stream (the first, then the gap between messages), kept
    with one timer per stream instead of one per message: marking a read costs two
    assignments, and the timer re-arms itself only when it fires early. Time the consumer
    spends between reads does not count. On expiry it cancels the call, so the pending read
    raises CancelledError with `has_expired` set (the task itself is not cancelled)."""

    def __init__(self, call: grpc.aio.Call, limit_s: float) -> None:
        self._call = call
        self._loop = asyncio.get_running_loop()
        self._limit_s = limit_s
        self._read_since: float | None = None
        self.has_expired = False
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(limit_s, self._check)

    def reading(self) -> None:
        self._read_since = self._loop.time()

    def idle(self, next_limit_s: float) -> None:
        self._read_since = None
        if next_limit_s != self._limit_s:  # once per stream: first-token -> inter-token limit
            self._limit_s = next_limit_s
            self.stop()
            self._timer = self._loop.call_later(next_limit_s, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        now = self._loop.time()
        since = self._read_since
        if since is not None and now - since >= self._limit_s:
            self.has_expired = True
            self._timer = None
            self._call.cancel()
            return
        self._timer = self._loop.call_at((since if since is not None else now) + self._limit_s, self._check)
