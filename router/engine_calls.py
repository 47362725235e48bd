"""The three MicroServing calls at the wire level: engine protos in, engine protos out, with
the attempt's bookkeeping around each (engines touched for the Abort fan-out, KV reservations,
in-flight counts per stage, stage deadlines, a failing engine taken out of rotation). Each
takes the engines and the attempt it runs for; nothing is looked up by request id.

The built-in patterns call these directly, so their tokens go from the engine's stream to
the client's with no per-token object in between; the MLC-named helpers of the programmable
API (`Router.send_prepare_receive` / `send_remote_send` / `send_start_generate`) convert their
pydantic requests and call the same functions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import grpc

from microserving import tracing
from microserving.transport import FAULT_METADATA_KEY, FAULT_RECEIVER
from microserving.v1 import engine_pb2
from router.attempt import Attempt, EngineJob
from router.deadlines import StageDeadline
from router.endpoint import STAGE_DECODE, STAGE_PREP_RECV, STAGE_REMOTE_SEND, Endpoint
from router.engines import Engines, EngineStream
from router.metrics import RouterMetrics
from router.policies import normalise_end
from router.streamed_decode import StreamedDecode

# A decode step as a pattern hands it back: a StartGenerate stream's messages, or a request
# on the engine's multiplexed stream.
Messages = AsyncGenerator[engine_pb2.StartGenerateResponse, None]
Decode = Messages | StreamedDecode[Any]


async def prep_recv(
    engines: Engines, endpoint: Endpoint, job: EngineJob, attempt: Attempt, end: int,
    *, whole_prompt: bool = False,
) -> tuple[bytes, int]:
    """PrepRecv on the receiver -> (kv_addr_info, prefix_matched_length); the reservation is
    counted on the engine until start_generate claims it or the attempt closes.
    `whole_prompt`: end may be len(prompt) (a start that continues from the sender's first
    tokens follows)."""
    attempt.touch(endpoint.address)
    message = engine_pb2.PrepRecvRequest(
        request_id=job.request_id, token_ids=job.wire_token_ids, end=end, sampling=job.sampling,
        whole_prompt=whole_prompt,
    )
    started_s = time.perf_counter()
    timeout_s = engines.settings.prep_recv_timeout_s
    stream = _call_stream(engines, endpoint, job, attempt)
    try:
        with endpoint.track(STAGE_PREP_RECV), _span("prep_recv", endpoint, job, attempt.traceparent) as span:
            if stream is None:
                reply = await endpoint.stub.PrepRecv(message, timeout=timeout_s,
                                                     metadata=tracing.metadata(span.traceparent))
            else:
                message.traceparent = span.traceparent
                output = await stream.call(job.request_id, engine_pb2.EngineGenerateRequest(prep_recv=message),
                                           timeout_s)
                reply = output.prep_recv
    except grpc.aio.AioRpcError as exc:
        raise engines.call_failed(exc, endpoint.address, "prep_recv") from exc
    engines.metrics.engine_call_s.labels(endpoint.address, "prep_recv").observe(time.perf_counter() - started_s)
    attempt.reserve(endpoint)
    return reply.kv_addr_info, reply.prefix_matched_length


async def remote_send(
    engines: Engines, endpoint: Endpoint, job: EngineJob, attempt: Attempt, *, begin: int, end: int,
    kv_addr_info: bytes, recv_rank: int, receiver: str | None = None,
) -> None:
    """RemoteSend on the sender; returns once the KV reached the receiver. When the sender
    says the receiver failed (trailing metadata), the error names `receiver` (if known)."""
    message = engine_pb2.RemoteSendRequest(
        request_id=job.request_id, token_ids=job.wire_token_ids, begin=begin, end=end,
        kv_addr_info=kv_addr_info, recv_rank=recv_rank, sampling=job.sampling,
    )
    await _remote_send(engines, endpoint, job, attempt, message, _call_stream(engines, endpoint, job, attempt),
                       receiver, lambda: begin)


async def _remote_send(
    engines: Engines, endpoint: Endpoint, job: EngineJob, attempt: Attempt,
    message: engine_pb2.RemoteSendRequest, stream: EngineStream | None, receiver: str | None,
    sent_from: Callable[[], int], on_first: Callable[[engine_pb2.GenerateOutput], None] | None = None,
) -> None:
    """The RemoteSend call, on `stream` or unary; `sent_from()`: where the window it moved
    began (for the transfer metrics); `on_first`: the output with its first tokens (a send
    made with sample_first_token, on a stream)."""
    attempt.touch(endpoint.address)
    started_s = time.perf_counter()
    timeout_s = engines.settings.remote_send_timeout_s
    try:
        with endpoint.track(STAGE_REMOTE_SEND), _span("remote_send", endpoint, job, attempt.traceparent) as span:
            if stream is None:
                await endpoint.stub.RemoteSend(message, timeout=timeout_s,
                                               metadata=tracing.metadata(span.traceparent))
            else:
                message.traceparent = span.traceparent
                await stream.call(job.request_id, engine_pb2.EngineGenerateRequest(remote_send=message),
                                  timeout_s, on_first)
    except grpc.aio.AioRpcError as exc:
        at_fault = receiver if receiver is not None and _blames_receiver(exc) else endpoint.address
        raise engines.call_failed(exc, at_fault, "remote_send") from exc
    num_tokens = normalise_end(message.end, len(job.token_ids)) - sent_from()
    observe_remote_send(engines.metrics, endpoint, num_tokens, time.perf_counter() - started_s)


def sends_ahead(engines: Engines, endpoint: Endpoint, job: EngineJob, attempt: Attempt) -> bool:
    """Whether the RemoteSend on `endpoint` can go out before the receiver's PrepRecv has
    answered (send_ahead): the setting allows it, the call goes on the engine's stream and the
    engine says it serves RemoteSendRequest.kv_addr_follows."""
    if not engines.settings.send_ahead or not attempt.use_engine_stream:
        return False
    status = endpoint.status
    return status is not None and status.takes_kv_addr_later and \
        engines.stream(endpoint).takes_calls(job.request_id)


def samples_first(engines: Engines, prefill: Endpoint, decode: Endpoint, attempt: Attempt) -> bool:
    """Whether P samples the first token (RemoteSendRequest.sample_first_token, D going on
    with StartGenerateRequest.continuations): the setting allows it, D's start can go with
    the send (starts_after_kv: on D's stream, after_kv_transfer served) and both engines say
    they serve it."""
    if not engines.settings.first_token_on_prefill or not starts_after_kv(engines, decode, attempt):
        return False
    return all(e.status is not None and e.status.samples_first_token for e in (prefill, decode))


class SendAhead:
    """A RemoteSend made before its receiver is known (RemoteSendRequest.kv_addr_follows):
    the sender computes the prompt's KV while the router makes the receiver's PrepRecv; `to`
    names the receiver (a `send_to` on the sender's stream, after the send's own message),
    `result` waits for the send's end, `cancel` undoes it on the sender. With
    `sample_first`, the sender also samples the first tokens: `first` resolves to the output
    that carries them."""

    def __init__(self, engines: Engines, endpoint: Endpoint, job: EngineJob, attempt: Attempt,
                 *, end: int, receiver: str, sample_first: bool = False) -> None:
        self._stream = engines.stream(endpoint)
        self._request_id = job.request_id
        self._begin = 0
        message = engine_pb2.RemoteSendRequest(
            request_id=job.request_id, token_ids=job.wire_token_ids, begin=0, end=end,
            sampling=job.sampling, kv_addr_follows=True, sample_first_token=sample_first,
        )
        self.first: asyncio.Future[engine_pb2.GenerateOutput] = asyncio.get_running_loop().create_future()
        self._metrics, self._address = engines.metrics, endpoint.address
        # Made now, its message is queued on the stream before anything the PrepRecv's answer
        # leads to (the send_to), which comes at least a round trip later.
        self._task = asyncio.ensure_future(_remote_send(
            engines, endpoint, job, attempt, message, self._stream, receiver, lambda: self._begin,
            self._on_first if sample_first else None))
        self._task.add_done_callback(_retrieve)  # a send dropped unawaited (cancel) logs nothing

    def _on_first(self, output: engine_pb2.GenerateOutput) -> None:
        if not self.first.done():
            self._metrics.first_tokens_from_prefill.labels(self._address).inc()
            self.first.set_result(output)

    def to(self, kv_addr_info: bytes, begin: int, recv_rank: int) -> None:
        self._begin = begin
        self._stream.send_to(engine_pb2.RemoteSendTarget(
            request_id=self._request_id, kv_addr_info=kv_addr_info, begin=begin, recv_rank=recv_rank))

    async def result(self) -> None:
        await self._task

    async def cancel(self) -> None:
        """Cancels the call (its `cancel` goes on the stream: the sender undoes it) and waits
        for it to settle."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()


def _call_stream(engines: Engines, endpoint: Endpoint, job: EngineJob, attempt: Attempt) -> EngineStream | None:
    """The engine's multiplexed stream when the call can go there (the runner's fast path, an
    engine that serves calls on it), else None: the unary call."""
    if not attempt.use_engine_stream:
        return None
    stream = engines.stream(endpoint)
    return stream if stream.takes_calls(job.request_id) else None


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


def decode(engines: Engines, endpoint: Endpoint, job: EngineJob, attempt: Attempt, begin: int) -> Decode:
    """The decode step of a pattern, not yet started: on the engine's multiplexed stream when
    the attempt asks for it (the runner's fast path), else a StartGenerate call."""
    stream = engines.stream(endpoint)
    if not attempt.use_engine_stream or not stream.is_supported:
        return start_generate(engines, endpoint, job, attempt, begin)
    return StreamedDecode(engines, endpoint, stream, _start_message(endpoint, job, attempt, begin))


def starts_after_kv(engines: Engines, endpoint: Endpoint, attempt: Attempt) -> bool:
    """Whether the decode on `endpoint` can start with the sender's RemoteSend instead of
    after it (decode_after): the setting allows it, the attempt decodes on the engine's
    stream and the engine says it serves StartGenerateRequest.after_kv_transfer."""
    if not engines.settings.start_after_kv or not attempt.use_engine_stream:
        return False
    status = endpoint.status
    return engines.stream(endpoint).is_supported and status is not None and status.starts_after_kv_transfer


def decode_after(
    engines: Engines, endpoint: Endpoint, job: EngineJob, attempt: Attempt, begin: int,
    send: Callable[[], Awaitable[None]],
) -> StreamedDecode[Any]:
    """The decode step, not yet started, whose start waits on the engine for its
    reservation's KV (after_kv_transfer); `send` (the RemoteSend that brings the KV) runs
    beside it, and its failure fails the decode (which then cancels it on the engine)."""
    message = _start_message(endpoint, job, attempt, begin)
    message.after_kv_transfer = True
    return StreamedDecode(engines, endpoint, engines.stream(endpoint), message, after=send)


def decode_continuing(
    engines: Engines, endpoint: Endpoint, job: EngineJob, attempt: Attempt, begin: int,
    send: Callable[[], Awaitable[None]], first: asyncio.Future[engine_pb2.GenerateOutput],
) -> StreamedDecode[Any]:
    """The decode step, not yet started, of a flow whose sender samples the first tokens
    (`send`, a SendAhead made with sample_first; `first`, its output with them): they go to
    the client as they come; the decode engine then starts with them
    (StartGenerateRequest.continuations), once its reservation's KV is in (after_kv_transfer),
    or is not started at all when every choice ended with them."""
    message = _start_message(endpoint, job, attempt, begin)
    message.after_kv_transfer = True
    return StreamedDecode(engines, endpoint, engines.stream(endpoint), message, after=send, first=first)


def _start_message(
    endpoint: Endpoint, job: EngineJob, attempt: Attempt, begin: int
) -> engine_pb2.StartGenerateRequest:
    """The decode start on `endpoint`, which claims the attempt's reservation there."""
    attempt.touch(endpoint.address)
    attempt.claim(endpoint)
    return engine_pb2.StartGenerateRequest(
        request_id=job.request_id, token_ids=job.wire_token_ids, begin=begin, sampling=job.sampling,
        traceparent=attempt.traceparent,
    )


async def start_generate(
    engines: Engines, endpoint: Endpoint, job: EngineJob, attempt: Attempt, begin: int
) -> AsyncGenerator[engine_pb2.StartGenerateResponse, None]:
    """StartGenerate on the receiver: its stream messages as they come, under the stage
    deadline. Closing the iterator early cancels the engine call."""
    message = _start_message(endpoint, job, attempt, begin)
    endpoint.acquire(STAGE_DECODE)
    call = endpoint.stub.StartGenerate(message)
    settings = engines.settings
    deadline = StageDeadline(settings.first_token_timeout_s, settings.inter_token_timeout_s, call.cancel)
    try:
        while True:
            deadline.waiting()
            try:
                reply = await call.read()
            except asyncio.CancelledError:
                if deadline.has_expired and _is_not_cancelled():
                    raise engines.call_failed(TimeoutError(), endpoint.address, "start_generate") from None
                raise
            except grpc.aio.AioRpcError as exc:
                failure = TimeoutError() if deadline.has_expired else exc  # ended by the deadline's cancel
                raise engines.call_failed(failure, endpoint.address, "start_generate") from exc
            deadline.arrived()
            if reply is grpc.aio.EOF:
                return
            yield reply
    finally:
        deadline.stop()
        endpoint.release(STAGE_DECODE)
        call.cancel()  # no-op after a clean end; aborts the engine request otherwise


def _is_not_cancelled() -> bool:
    task = asyncio.current_task()
    return task is None or not task.cancelling()
