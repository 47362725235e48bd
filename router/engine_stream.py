"""The router's end of Engine.Generate: one long-lived multiplexed stream per engine, over
which the built-in patterns start their decode (a message, not a call) and receive every
request's output in the engine's batched messages.

`EngineStream` owns the call: opened on first use, dropped when it breaks (the next request
opens a new one). Its reader task hands each request's output straight to that request's
`StreamedDecode` (no task switch per request per message); a broken stream fails every
request on it with the stream's status, which the runner treats like a failed StartGenerate
(retry before the first token, resume after it). `StreamedDecode` keeps the first-token and
inter-token deadlines with one timer per request and cancels its request on the engine when
it ends early.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

import grpc

from microserving.multiplex import MultiplexedCall
from microserving.transport import status_code
from microserving.v1 import engine_pb2
from router.endpoint import STAGE_DECODE, Endpoint

if TYPE_CHECKING:
    from router.router import Router

logger = logging.getLogger(__name__)

T = TypeVar("T")
_STAGE = "start_generate"


class EngineStream:
    """One engine's multiplexed Generate stream, shared by every request the router decodes
    there (a `microserving.multiplex.MultiplexedCall`, replaced when it breaks)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._call: MultiplexedCall[engine_pb2.EngineGenerateResponse, engine_pb2.GenerateOutput] | None = None
        # False once the engine answered UNIMPLEMENTED (a shim from before Engine.Generate):
        # its requests then go through StartGenerate.
        self.is_supported = True

    def _current(self) -> MultiplexedCall[engine_pb2.EngineGenerateResponse, engine_pb2.GenerateOutput]:
        call = self._call
        if call is None or not call.is_usable():
            call = self._call = MultiplexedCall(
                self.endpoint.stub.Generate(), _outputs_of, _request_id_of, on_broken=self._on_broken)
        return call

    def _on_broken(self, error: grpc.aio.AioRpcError) -> None:
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.is_supported = False
            logger.warning("engine %s does not serve Engine.Generate; using StartGenerate",
                           self.endpoint.address)

    async def start(self, request: engine_pb2.StartGenerateRequest, decode: StreamedDecode[object]) -> None:
        """Send `start`; from now on `decode` gets the request's output. Raises
        grpc.aio.AioRpcError when the stream cannot take it (it is then dropped)."""
        message = engine_pb2.EngineGenerateRequest(start=request)
        await self._current().start(request.request_id, message, decode)

    def cancel(self, request_id: str) -> None:
        """Abort a request that has not ended (no-op otherwise); its output is dropped."""
        if self._call is not None:
            cancel = engine_pb2.GenerateCancel(request_id=request_id)
            self._call.cancel(request_id, engine_pb2.EngineGenerateRequest(cancel=cancel))

    async def close(self) -> None:
        if self._call is not None:
            await self._call.close()


def _outputs_of(message: engine_pb2.EngineGenerateResponse) -> Sequence[engine_pb2.GenerateOutput]:
    return message.outputs  # type: ignore[return-value]


def _request_id_of(output: engine_pb2.GenerateOutput) -> str:
    return output.request_id


class StreamedDecode(Generic[T]):
    """One request's decode on an engine's stream, not yet started: `run(on_output)` starts
    it and feeds each of its outputs to `on_output` (in the stream's reader task) until that
    returns a value, the request finishes (-> None) or fails (EngineCallError)."""

    def __init__(self, router: Router, endpoint: Endpoint, stream: EngineStream,
                 request: engine_pb2.StartGenerateRequest) -> None:
        self._router = router
        self._endpoint = endpoint
        self._stream = stream
        self._request = request
        self._on_output: Callable[[engine_pb2.GenerateOutput], T | None] | None = None
        self._result: asyncio.Future[T | None] | None = None
        self._is_ended = False  # the engine ended the request (finished or failed)
        self._timer: asyncio.TimerHandle | None = None
        self._last_s = 0.0
        self._limit_s = router.settings.first_token_timeout_s

    @property
    def request_id(self) -> str:
        return self._request.request_id

    async def run(self, on_output: Callable[[engine_pb2.GenerateOutput], T | None]) -> T | None:
        loop = asyncio.get_running_loop()
        self._on_output = on_output
        self._result = loop.create_future()
        self._last_s = loop.time()
        self._timer = loop.call_later(self._limit_s, self._check)
        self._endpoint.acquire(STAGE_DECODE)
        try:
            try:
                await self._stream.start(self._request, self)  # type: ignore[arg-type]
            except grpc.aio.AioRpcError as exc:
                self._is_ended = True
                raise self._router.call_failed(exc, self._endpoint.address, _STAGE) from exc
            return await self._result
        finally:
            if self._timer is not None:
                self._timer.cancel()
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
        self._limit_s = self._router.settings.inter_token_timeout_s
        self._last_s = result.get_loop().time()
        if output.HasField("error"):
            error = output.error
            result.set_exception(self._router.call_failed_with(
                status_code(error.code), error.message, self._endpoint.address, _STAGE))
            return True
        assert self._on_output is not None  # set by run() before the start is sent
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
            result.set_exception(self._router.call_failed_with(
                error.code(), error.details() or "", self._endpoint.address, _STAGE))

    def _check(self) -> None:
        """The stage deadline: first output within first_token_timeout_s, then gaps under
        inter_token_timeout_s; re-armed only when it fires early."""
        result = self._result
        if result is None or result.done():
            self._timer = None
            return
        loop = result.get_loop()
        due = self._last_s + self._limit_s
        if loop.time() >= due:
            self._timer = None
            result.set_exception(self._router.call_failed(TimeoutError(), self._endpoint.address, _STAGE))
            return
        self._timer = loop.call_at(due, self._check)
