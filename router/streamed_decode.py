"""One request's decode on an engine's multiplexed Generate stream (engines.EngineStream).

The stream's reader hands each of the request's outputs straight to it (no task switch per
request per message); a broken stream fails every request on it with the stream's status,
which the runner treats like a failed StartGenerate (retry before the first token, resume
after it). The stage deadline is one StageDeadline per request; a request that ends early is
cancelled on the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

import grpc

from microserving.transport import status_code
from microserving.v1 import engine_pb2
from router.deadlines import StageDeadline
from router.endpoint import STAGE_DECODE, Endpoint
from router.engines import Engines, EngineStream

T = TypeVar("T")
_STAGE = "start_generate"


class StreamedDecode(Generic[T]):
    """Not yet started: `run(on_output)` starts it and feeds each of its outputs to
    `on_output` (in the stream's reader task) until that returns a value, the request
    finishes (-> None) or fails (EngineCallError)."""

    def __init__(self, engines: Engines, endpoint: Endpoint, stream: EngineStream,
                 request: engine_pb2.StartGenerateRequest) -> None:
        self._engines = engines
        self._endpoint = endpoint
        self._stream = stream
        self._request = request
        self._on_output: Callable[[engine_pb2.GenerateOutput], T | None] | None = None
        self._result: asyncio.Future[T | None] | None = None
        self._is_ended = False  # the engine ended the request (finished or failed)
        self._deadline: StageDeadline | None = None

    @property
    def request_id(self) -> str:
        return self._request.request_id

    async def run(self, on_output: Callable[[engine_pb2.GenerateOutput], T | None]) -> T | None:
        settings = self._engines.settings
        self._on_output = on_output
        self._result = asyncio.get_running_loop().create_future()
        self._deadline = StageDeadline(settings.first_token_timeout_s, settings.inter_token_timeout_s,
                                       self._expire)
        self._deadline.waiting()
        self._endpoint.acquire(STAGE_DECODE)
        try:
            try:
                await self._stream.start(self._request, self)
            except grpc.aio.AioRpcError as exc:
                self._is_ended = True
                raise self._engines.call_failed(exc, self._endpoint.address, _STAGE) from exc
            return await self._result
        finally:
            self._deadline.stop()
            self._endpoint.release(STAGE_DECODE)
            if not self._is_ended:
                self._stream.cancel(self.request_id)  # aborts the engine request

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
        deadline.arrived()
        deadline.waiting()  # the engine owes the next output from now
        if output.HasField("error"):
            error = output.error
            result.set_exception(self._engines.call_failed_with(
                status_code(error.code), error.message, self._endpoint.address, _STAGE))
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
