"""Engine.Generate: many requests over one bidirectional stream, their output batched.

Each started request runs as a task over its backend's `run_generate`, which hands every output
to `_on_output` as the engine delivers it (for the embedded engine: all of one step's outputs
in one event-loop callback, no task switch per output). Outputs go into the message being
built (`microserving.multiplex.Batcher`, one entry per request, merged when several steps'
output queue up); the stream's writer sends the whole message whenever it is free. A request's
first and last outputs go out as soon as the writer can write; errors end only their request, with the
status code StartGenerate would have given; `cancel`, the caller going away or the stream
breaking cancel the per-request tasks, which aborts those requests on the engine.

The stream also carries PrepRecv and RemoteSend (`StreamCalls`, the servicer's own): each runs
as a task of its own under its request id and ends with one output holding its result or its
error, written at once; `cancel` cancels it and then aborts its request on the engine (also
when it had ended: the caller's Abort travels on a call of its own and could overtake the
call's message), and a stream that breaks aborts the calls it cut off. A RemoteSend made with
kv_addr_follows runs from its message on; the `send_to` that names its receiver reaches it
through a future (dropped when no such send waits), and one still waiting when the caller
half-closes fails INVALID_ARGUMENT. A RemoteSend made with sample_first_token has one output
more, before its result: its first tokens, written at once. A call costs
the caller a message each way on a stream it already has, not a call (HTTP/2 stream, task,
metadata) each.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from engine_shim.convert import add_first_tokens, add_generate_output
from engine_shim.engine.api import EngineError, GenerateOutput, InvalidRequestError, OnFirst
from engine_shim.errors import status_code_for
from microserving import tracing
from microserving.multiplex import Batcher
from microserving.v1 import engine_pb2

logger = logging.getLogger(__name__)

# Runs one request to its end, handing each output to the callback; raises the errors
# StartGenerate would (validation, duplicates, engine errors). Cancelling it aborts the request.
RunFn = Callable[
    [engine_pb2.StartGenerateRequest, Callable[[GenerateOutput], None]], Awaitable[None]
]


class StreamCalls(Protocol):
    """PrepRecv and RemoteSend as the unary calls run them (the servicer), given the trace
    context the message carries; they raise what the unary calls would."""

    async def prep_recv(
        self, request: engine_pb2.PrepRecvRequest, traceparent: str
    ) -> engine_pb2.PrepRecvResponse: ...

    async def remote_send(
        self, request: engine_pb2.RemoteSendRequest, traceparent: str,
        target: Awaitable[engine_pb2.RemoteSendTarget] | None = None, on_first: OnFirst | None = None,
    ) -> engine_pb2.RemoteSendResponse:
        """`target`: where the `send_to` of a send made with kv_addr_follows arrives;
        `on_first`: where the first tokens of a send made with sample_first_token go."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Engine.Abort: frees whatever the request holds on the engine."""
        ...


_ABORTS: set[asyncio.Task[None]] = set()  # aborts after a cancel, referenced until they end


class GenerateMultiplexer:
    """One Engine.Generate stream: per-request tasks in, batched messages out."""

    def __init__(self, run: RunFn, stream_interval_s: float = 0.0,
                 updates_per_s: float = 0.0, calls: StreamCalls | None = None) -> None:
        """`stream_interval_s`: least time between two messages that carry no request's first
        output (0: a message whenever the writer is free, i.e. one per engine step).
        `updates_per_s`: with N requests running, messages are at least N / updates_per_s
        apart, so the stream carries at most that many request updates a second whatever the
        concurrency (every hop downstream pays per update: a gRPC entry, an SSE chunk, a
        socket write); 0: no such bound. `calls`: what runs the PrepRecv and RemoteSend made on
        the stream (None: they fail UNIMPLEMENTED)."""
        self._run_request = run
        self._calls = calls
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._call_ids: set[str] = set()  # tasks that run a call, not a generation
        # RemoteSends made with kv_addr_follows, waiting for their send_to
        self._targets: dict[str, asyncio.Future[engine_pb2.RemoteSendTarget]] = {}
        self._stream_interval_s = stream_interval_s
        self._updates_per_s = updates_per_s
        self._out: Batcher[engine_pb2.EngineGenerateResponse, engine_pb2.GenerateOutput] = \
            Batcher(engine_pb2.EngineGenerateResponse, lambda batch: batch.outputs,
                    min_interval_s=stream_interval_s)
        self._has_output: set[str] = set()  # requests whose first output is queued or sent
        self._is_reading = True

    async def serve(
        self, requests: AsyncIterator[engine_pb2.EngineGenerateRequest]
    ) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        try:
            while (batch := await self._out.take()) is not None:
                yield batch
        finally:
            # The caller went away, the stream broke or everything ended: abort what runs.
            reader.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            for request_id in list(self._call_ids):  # calls cut off: what they did is undone
                self._abort_after(request_id, self._tasks.get(request_id))
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    def _close_if_idle(self) -> None:
        if not self._is_reading and not self._tasks:
            self._out.close()

    async def _read(self, requests: AsyncIterator[engine_pb2.EngineGenerateRequest]) -> None:
        try:
            async for message in requests:
                if message.WhichOneof("action") == "batch":
                    for action in message.batch.actions:
                        self._take(action)
                else:
                    self._take(message)
        finally:
            self._is_reading = False
            for target in self._targets.values():  # no send_to can come any more
                if not target.done():
                    target.set_exception(InvalidRequestError(
                        "the stream was closed before this RemoteSend's send_to came"))
                    target.exception()  # retrieved: the send may have failed before its wait
            self._targets.clear()
            self._close_if_idle()

    def _take(self, message: engine_pb2.EngineGenerateRequest) -> None:
        """One action of the stream, alone or from a batch (in the batch's order; _read
        unpacks a batch that comes alone, so one here is inside another)."""
        action = message.WhichOneof("action")
        if action == "start":
            self._begin(message.start.request_id, self._run(message.start))
        elif action == "cancel":
            self._cancel(message.cancel.request_id)
        elif action == "prep_recv" or action == "remote_send":
            self._begin_call(action, getattr(message, action))
        elif action == "send_to":
            self._send_to(message.send_to)
        elif action == "batch":
            logger.warning("Engine.Generate: a batch inside a batch, ignored")
        else:
            logger.warning("Engine.Generate: a message with no known action, ignored")

    def _begin(self, request_id: str, work: Coroutine[Any, Any, None], is_call: bool = False) -> bool:
        if request_id in self._tasks:
            work.close()
            # Their outputs could not be told apart: the running request ends too.
            self._cancel(request_id)
            self._fail(request_id, grpc.StatusCode.ALREADY_EXISTS,
                       f"request {request_id!r} was already active on this stream; both are aborted")
            return False
        task = asyncio.get_running_loop().create_task(work)
        self._tasks[request_id] = task
        if is_call:
            self._call_ids.add(request_id)
        self._set_interval()
        return True

    def _begin_call(self, action: str, request: engine_pb2.PrepRecvRequest | engine_pb2.RemoteSendRequest) -> None:
        calls = self._calls
        if calls is None:
            self._fail(request.request_id, grpc.StatusCode.UNIMPLEMENTED,
                       f"this engine does not take {action} on Engine.Generate")
            return
        run: Callable[..., Awaitable[Message]] = getattr(calls, action)
        target: asyncio.Future[engine_pb2.RemoteSendTarget] | None = None
        if isinstance(request, engine_pb2.RemoteSendRequest) and request.kv_addr_follows:
            target = asyncio.get_running_loop().create_future()
            run = functools.partial(run, target=target)
        if isinstance(request, engine_pb2.RemoteSendRequest) and request.sample_first_token:
            run = functools.partial(run, on_first=functools.partial(self._on_first, request.request_id))
        if self._begin(request.request_id, self._run_call(action, run, request, target), is_call=True) \
                and target is not None:
            self._targets[request.request_id] = target

    def _send_to(self, target: engine_pb2.RemoteSendTarget) -> None:
        """The receiver of a RemoteSend waiting on this stream; dropped when none waits (it
        ended or was cancelled: its own output or cancel tells the caller)."""
        waiting = self._targets.pop(target.request_id, None)
        if waiting is None or waiting.done():
            logger.debug("Engine.Generate: send_to for %r with no RemoteSend waiting, dropped",
                         target.request_id)
            return
        waiting.set_result(target)

    def _set_interval(self) -> None:
        interval_s = self._stream_interval_s
        if self._updates_per_s:  # generations only: a call sends one output, at once
            num_running = len(self._tasks) - len(self._call_ids)
            interval_s = max(interval_s, num_running / self._updates_per_s)
        self._out.min_interval_s = interval_s

    def _cancel(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        was_call = request_id in self._call_ids
        self._call_ids.discard(request_id)
        if task is not None:
            task.cancel()  # a generation's task aborts its request as it ends
        self._out.discard(request_id)  # nothing more goes out for a cancelled request
        if was_call or task is None:
            # A call may have done its work on the engine (a reservation made, KV computed)
            # before the cancel came, and one that ended did: the request is aborted on the
            # engine, as the caller's Abort would. The caller's Abort is no substitute: it
            # travels on a call of its own and may overtake the call's message on this stream.
            self._abort_after(request_id, task)

    def _abort_after(self, request_id: str, task: asyncio.Task[None] | None) -> None:
        calls = self._calls
        if calls is None:
            return

        async def abort() -> None:
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)  # its cancellation settles first
            try:
                await calls.abort(request_id)
            except Exception as error:  # noqa: BLE001 - e.g. an invalid id: nothing to abort
                logger.debug("Engine.Generate: abort of %r after its cancel: %s", request_id, error)

        aborting = asyncio.get_running_loop().create_task(abort())
        _ABORTS.add(aborting)  # runs to its end even after the stream ends
        aborting.add_done_callback(_ABORTS.discard)

    def _on_output(self, request_id: str, output: GenerateOutput) -> None:
        is_first = request_id not in self._has_output
        if is_first:
            self._has_output.add(request_id)
        # A first output is never held back by the stream interval (time to first token), nor
        # a last one: the caller waits for it to end the request (and, in a closed loop, to send
        # the next), and it comes once per request.
        urgent = is_first or output.is_finished
        entry, _ = self._out.keyed(request_id, urgent=urgent, request_id=request_id)
        add_generate_output(entry, output)
        if output.is_finished:
            self._out.seal(request_id)  # a later request under the id gets an entry of its own

    def _on_first(self, request_id: str, output: GenerateOutput, states: tuple[bytes, ...]) -> None:
        """A RemoteSend's first tokens (sample_first_token): an output of their own, at once,
        before the call's result (which goes into the same entry if it is still queued)."""
        if request_id not in self._tasks:
            return  # cancelled meanwhile
        entry, _ = self._out.keyed(request_id, urgent=True, request_id=request_id)
        add_first_tokens(entry, output, states)

    async def _run(self, start: engine_pb2.StartGenerateRequest) -> None:
        request_id = start.request_id
        await self._guarded(request_id, self._run_request(
            start, lambda output: self._on_output(request_id, output)))

    async def _run_call(self, action: str, run: Callable[[Any, str], Awaitable[Message]],
                        request: engine_pb2.PrepRecvRequest | engine_pb2.RemoteSendRequest,
                        target: asyncio.Future[engine_pb2.RemoteSendTarget] | None = None) -> None:
        async def call() -> None:
            result = await run(request, tracing.valid_traceparent(request.traceparent))
            entry, _ = self._out.keyed(request.request_id, urgent=True, request_id=request.request_id)
            getattr(entry, action).CopyFrom(result)
            self._out.seal(request.request_id)

        try:
            await self._guarded(request.request_id, call())
        finally:
            if target is not None and self._targets.get(request.request_id) is target:
                del self._targets[request.request_id]

    async def _guarded(self, request_id: str, work: Awaitable[None]) -> None:
        """Runs one request's task: its errors end it (not the stream) with the status code the
        unary call would have had."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except EngineError as error:
            self._fail(request_id, status_code_for(error), str(error) or type(error).__name__,
                       getattr(error, "fault", None) or "")
        except Exception:  # noqa: BLE001 - one request's failure must not end the stream
            logger.exception("Engine.Generate: request %s failed", request_id)
            self._fail(request_id, grpc.StatusCode.INTERNAL, "internal error")
        finally:
            if self._tasks.get(request_id) is asyncio.current_task():
                del self._tasks[request_id]
                self._call_ids.discard(request_id)
                self._has_output.discard(request_id)
                self._set_interval()
                self._close_if_idle()

    def _fail(self, request_id: str, code: grpc.StatusCode, message: str, fault: str = "") -> None:
        entry, _ = self._out.keyed(request_id, urgent=True, request_id=request_id)
        entry.error.code = code.value[0]
        entry.error.message = message
        entry.error.fault = fault
        self._out.seal(request_id)
