"""Engine.Generate: many requests over one bidirectional stream, their output batched.

Each started request runs as a task over its backend's per-request output stream (the same
`Backend.generate` StartGenerate uses, so every backend gets this for free) and appends what
it produces to the batch being built; the stream's writer sends the whole batch as one
message whenever it is free. A request's first output goes out as soon as the writer can
write (nothing waits for other requests); outputs that queue while the writer is busy share
the next message. Errors end only their request, with the status code StartGenerate would
have given; `cancel`, the caller going away or the stream breaking close the per-request
streams, which aborts those requests on the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from engine_shim.convert import add_generate_output
from engine_shim.engine.api import EngineError, GenerateOutput
from engine_shim.errors import status_code_for
from microserving.v1 import engine_pb2

logger = logging.getLogger(__name__)

# (request_id, StartGenerateRequest) -> the request's outputs; raises the errors StartGenerate
# would (validation, duplicates, engine errors). Closing the iterator aborts the request.
StartFn = Callable[[engine_pb2.StartGenerateRequest], AsyncIterator[GenerateOutput]]


class GenerateMultiplexer:
    """One Engine.Generate stream: per-request tasks in, batched messages out."""

    def __init__(self, start: StartFn) -> None:
        self._start = start
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._batch = engine_pb2.EngineGenerateResponse()
        self._entries: dict[str, engine_pb2.GenerateOutput] = {}  # request id -> its entry in _batch
        self._waiter: asyncio.Future[None] | None = None
        self._is_reading = True

    async def serve(
        self, requests: AsyncIterator[engine_pb2.EngineGenerateRequest]
    ) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        try:
            while True:
                if self._entries:
                    batch, self._batch, self._entries = self._batch, engine_pb2.EngineGenerateResponse(), {}
                    yield batch
                    continue
                if not self._is_reading and not self._tasks:
                    return
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
        finally:
            # The caller went away, the stream broke or everything ended: abort what runs.
            reader.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _entry(self, request_id: str) -> engine_pb2.GenerateOutput:
        entry = self._entries.get(request_id)
        if entry is None:
            entry = self._batch.outputs.add(request_id=request_id)
            self._entries[request_id] = entry
            self._wake()
        return entry

    async def _read(self, requests: AsyncIterator[engine_pb2.EngineGenerateRequest]) -> None:
        try:
            async for message in requests:
                action = message.WhichOneof("action")
                if action == "start":
                    self._begin(message.start)
                elif action == "cancel":
                    self._cancel(message.cancel.request_id)
                else:
                    logger.warning("Engine.Generate: a message with neither start nor cancel, ignored")
        finally:
            self._is_reading = False
            self._wake()

    def _begin(self, start: engine_pb2.StartGenerateRequest) -> None:
        request_id = start.request_id
        if request_id in self._tasks:
            # Their outputs could not be told apart: the running request ends too.
            self._cancel(request_id)
            self._fail(request_id, grpc.StatusCode.ALREADY_EXISTS,
                       f"request {request_id!r} was already active on this stream; both are aborted")
            return
        task = asyncio.get_running_loop().create_task(self._run(start))
        self._tasks[request_id] = task

    def _cancel(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
        entry = self._entries.pop(request_id, None)
        if entry is not None:  # nothing more goes out for a cancelled request
            self._batch.outputs.remove(entry)

    async def _run(self, start: engine_pb2.StartGenerateRequest) -> None:
        request_id = start.request_id
        try:
            outputs = self._start(start)
            try:
                async for output in outputs:
                    add_generate_output(self._entry(request_id), output)
            finally:
                await outputs.aclose()  # type: ignore[attr-defined]  # aborts an unfinished request
        except asyncio.CancelledError:
            raise
        except EngineError as error:
            self._fail(request_id, status_code_for(error), str(error) or type(error).__name__)
        except Exception:  # noqa: BLE001 - one request's failure must not end the stream
            logger.exception("Engine.Generate: request %s failed", request_id)
            self._fail(request_id, grpc.StatusCode.INTERNAL, "internal error")
        finally:
            if self._tasks.get(request_id) is asyncio.current_task():
                del self._tasks[request_id]
                if not self._is_reading:
                    self._wake()

    def _fail(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        entry = self._entry(request_id)
        entry.error.code = code.value[0]
        entry.error.message = message
