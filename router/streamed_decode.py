"""One request's decode on an engine's multiplexed Generate stream (engines.EngineStream).

The stream's reader hands each of the request's outputs straight to it (no task switch per
request per message); a broken stream fails every request on it with the stream's status,
which the runner treats like a failed StartGenerate (retry before the first token, resume
after it). The stage deadline is one StageDeadline per request; a request that ends early is
cancelled on the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import grpc

from microserving.transport import status_code
from microserving.v1 import engine_pb2
from router.deadlines import StageDeadline
from router.endpoint import STAGE_DECODE, Endpoint
from router.engines import Engines, EngineStream
from router.errors import EngineCallError

T = TypeVar("T")
_STAGE = "start_generate"


class StreamedDecode(Generic[T]):
    """Not yet started: `run(on_output)` starts it and feeds each of its outputs to
    `on_output` (in the stream's reader task) until that returns a value, the request
    finishes (-> None) or fails (EngineCallError)."""

    def __init__(self, engines: Engines, endpoint: Endpoint, stream: EngineStream,
                 request: engine_pb2.StartGenerateRequest,
                 after: Callable[[], Awaitable[None]] | None = None,
                 first: asyncio.Future[engine_pb2.GenerateOutput] | None = None) -> None:
        """`after`: the call that brings the request's KV (a RemoteSend), for a start that
        waits for it on the engine (after_kv_transfer): run beside the decode from its start;
        its failure is the decode's. `first`: that call's output with the first tokens (a send
        that samples them): relayed first; the start goes out with their continuations, or
        not at all when the request ended with them."""
        self._engines = engines
        self._after = after
        self._first = first
        self._endpoint = endpoint
        self._stream = stream
        self._request = request
        self._on_output: Callable[[engine_pb2.GenerateOutput], T | None] | None = None
        self._result: asyncio.Future[T | None] | None = None
        self._is_ended = False  # the engine ended the request (finished or failed)
        self._deadline: StageDeadline | None = None
        self._has_output = False
        self._sending: asyncio.Future[None] | None = None  # `after`, running
        # this engine's failure while the sender still ran: the decode's unless the send fails
        self._held_error: EngineCallError | None = None

    @property
    def request_id(self) -> str:
        return self._request.request_id

    async def run(self, on_output: Callable[[engine_pb2.GenerateOutput], T | None]) -> T | None:
        settings = self._engines.settings
        self._on_output = on_output
        self._result = asyncio.get_running_loop().create_future()
        self._deadline = StageDeadline(settings.first_token_timeout_s, settings.inter_token_timeout_s,
                                       self._expire)
        if self._after is None:
            self._deadline.waiting()
        # else the first-token clock starts once the KV's sender has returned: until then the
        # wait is the sender's (under its own deadline), not this engine's
        self._endpoint.acquire(STAGE_DECODE)
        # The KV's sender first: its engine's work is the longer way to the first token.
        after = self._sending = asyncio.ensure_future(self._after()) if self._after is not None else None
        if after is not None:
            after.add_done_callback(self._after_done)
        is_done = False
        try:
            if self._first is not None:
                assert after is not None  # the send that samples them
                first = await self._first_output(after)
                value = on_output(first)
                if value is not None or first.HasField("usage"):
                    # The request ended with its first tokens (or the relay ended the attempt):
                    # nothing starts here; the send is cancelled (below) and the reservation it
                    # was filling is aborted.
                    self._is_ended = True
                    self._stream.abort_unstarted(self.request_id)
                    return value
                self._request.continuations.extend(first.continuations)
            try:
                await self._stream.start(self._request, self)
            except grpc.aio.AioRpcError as exc:
                self._is_ended = True
                raise self._engines.call_failed(exc, self._endpoint.address, _STAGE) from exc
            value = await self._result
            is_done = True
            return value
        finally:
            self._deadline.stop()
            self._endpoint.release(STAGE_DECODE)
            if not self._is_ended:
                self._stream.cancel(self.request_id)  # aborts the engine request
            if after is not None:
                if not self._result.done():  # run() is ending: nobody reads it any more
                    self._result.cancel()
                await _settle(after, is_done)

    async def _first_output(self, after: asyncio.Future[None]) -> engine_pb2.GenerateOutput:
        """The sender's output with the first tokens, or the sender's failure."""
        first = self._first
        assert first is not None
        waits: list[asyncio.Future[Any]] = [first, after]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if first.done():
            output = first.result()
            if len(output.continuations) == len(output.choices) and output.continuations:
                return output
            raise EngineCallError(
                f"remote_send for {self.request_id} sent first tokens without their continuations",
                code=grpc.StatusCode.INTERNAL, address="", stage="remote_send", detail="no continuations")
        after.result()  # raises the send's error
        raise EngineCallError(
            f"remote_send for {self.request_id} ended without the first tokens it was to sample",
            code=grpc.StatusCode.INTERNAL, address="", stage="remote_send", detail="no first tokens")

    def _after_done(self, after: asyncio.Future[None]) -> None:
        """The KV's sender ended: a failure ends the decode with its error."""
        result = self._result
        if result is None or result.done():
            if not after.cancelled():
                after.exception()  # retrieved: the decode has ended its own way
            return
        if after.cancelled():  # not by run(), which ends the result before it cancels this
            result.set_exception(self._held_error or EngineCallError(
                f"remote_send for {self.request_id} was cancelled", code=grpc.StatusCode.UNAVAILABLE,
                address="", stage="remote_send", detail="cancelled"))
            return
        error = after.exception()
        if error is not None:
            result.set_exception(error)
        elif self._held_error is not None:
            result.set_exception(self._held_error)
        elif not self._has_output and self._deadline is not None:
            self._deadline.waiting()

    def deliver(self, output: engine_pb2.GenerateOutput) -> bool:
        """One output from the engine (in the stream's reader task); True when it was the
        request's last."""
        is_last = output.HasField("usage") or output.HasField("error")
        self._is_ended = self._is_ended or is_last
        result = self._result
        if result is None or result.done():
            return is_last  # run() is ending; an unfinished request is cancelled there
        deadline = self._deadline
        assert deadline is not None and self._on_output is not None  # set by run() before the start
        self._has_output = True
        deadline.arrived()
        deadline.waiting()  # the engine owes the next output from now
        if output.HasField("error"):
            error = output.error
            failure = self._engines.call_failed_with(
                status_code(error.code), error.message, self._endpoint.address, _STAGE)
            sending = self._sending
            if sending is not None and not sending.done():
                # A start waiting for its KV fails when the transfer does (its reservation
                # ends): the sender's outcome says why, and which engine is at fault.
                self._held_error = failure
            else:
                result.set_exception(failure)
            return True
        try:
            value = self._on_output(output)
        except Exception as exc:  # noqa: BLE001 - surfaces in run()
            result.set_exception(exc)
            return is_last
        if value is not None or is_last:
            result.set_result(value)
        return is_last

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        """The stream broke under this request."""
        result = self._result
        self._is_ended = True
        if result is not None and not result.done():
            result.set_exception(self._engines.call_failed_with(
                error.code(), error.details() or "", self._endpoint.address, _STAGE))

    def _expire(self) -> None:
        result = self._result
        if result is not None and not result.done():
            result.set_exception(self._engines.call_failed(TimeoutError(), self._endpoint.address, _STAGE))


async def _settle(after: asyncio.Future[None], is_done: bool) -> None:
    """Let the KV's sender end with its decode: a decode that ended well leaves it to finish
    (the KV has landed: only its answer is still on the way); any other end cancels it (its
    call, and so the send, is cancelled on the sender's engine). Either way it has ended on
    return, its outcome taken (a failure is the decode's, set by _after_done)."""
    if not is_done:
        after.cancel()
    await asyncio.wait({after})
