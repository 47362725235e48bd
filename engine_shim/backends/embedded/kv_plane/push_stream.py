"""KVTransfer.PushKVStream, both ends: many staged pushes to one peer over one long-lived
stream.

A push through the receiver's shared-memory stage carries no KV bytes, only a header, each
chunk's window and its end; as a PushKV call of its own it costs both shims a call (an HTTP/2
stream, its metadata, a handler task) per request, more than the messages themselves. On a
stream the sender keeps open to the peer, the same push is a few entries, and what either
end queued while its writer was busy goes out in one message (`microserving.multiplex`:
`MultiplexedCall` on the sender, `Batcher` on the receiver, as on the engine streams).

Pushes that carry KV bytes (the gRPC transport, across hosts) stay calls of their own: each
has its own flow control there, so a push of megabytes never holds up the small ones queued
behind it.

The receiver runs each push as PushKV does (`KVTransferServicer.serve_push`), fed its
entries in order; its result (or error, with PushKV's status code) is written at once. The
sender's push (`push_streamed`) writes its entries and waits for that result; when it gives
up (its engine failed, it was cancelled, its receiver stalled) it writes `cancel`, and the
receiver aborts the reservation as for a PushKV call that breaks off. A stream that breaks
ends every push on it on both sides: the receiver aborts their reservations, the senders get
UNAVAILABLE, and the next push opens a new stream."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from engine_shim.engine.api import EngineError, KVChunk
from engine_shim.errors import status_code_for
from microserving.multiplex import Batcher, MultiplexedCall
from microserving.v1 import engine_pb2

logger = logging.getLogger(__name__)

PUSH_KV_STREAM_METHOD = "/microserving.v1.KVTransfer/PushKVStream"

ChunkFields = tuple[int, int, bytes | memoryview]  # begin, num_tokens, data (empty: in the stage)
# Runs one push as PushKV does: its header, then its chunks until they end.
ServeFn = Callable[[engine_pb2.KVPushHeader, AsyncIterator[ChunkFields]],
                   Awaitable[engine_pb2.PushKVResponse]]


class _Ended:
    """Marks the end of a push's chunks (its `end`, or the sender half-closing)."""


class _GivenUp(Exception):
    """The push was broken off before its task began: it aborts what it claimed."""


_END, _GIVEN_UP = _Ended(), _Ended()


class _OpenPush:
    """A push the receiver runs: its task and the chunks that reached it, not yet taken."""

    def __init__(self) -> None:
        self.entries: asyncio.Queue[engine_pb2.KVChunkData | _Ended] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.has_begun = False

    async def chunks(self) -> AsyncIterator[ChunkFields]:
        while not isinstance(entry := await self.entries.get(), _Ended):
            yield entry.begin, entry.num_tokens, entry.data
        if entry is _GIVEN_UP:
            raise _GivenUp

    def break_off(self) -> None:
        """Ends the push; the reservation it claimed is aborted. A task cancelled before it
        began would never run, and never abort: that one runs and meets _GIVEN_UP instead."""
        self.entries.put_nowait(_GIVEN_UP)
        if self.has_begun and self.task is not None:
            self.task.cancel()


class StreamedPushes:
    """The receiving end of one PushKVStream: a task per push, results batched out."""

    def __init__(self, serve: ServeFn) -> None:
        self._serve = serve
        self._pushes: dict[int, _OpenPush] = {}
        self._out: Batcher[engine_pb2.PushKVStreamResponse, engine_pb2.PushKVResult] = \
            Batcher(engine_pb2.PushKVStreamResponse, lambda message: message.results)
        self._is_reading = True
        self._is_draining = False

    def drain(self) -> None:
        """New pushes are refused (UNAVAILABLE); the stream ends once the open ones have."""
        self._is_draining = True
        self._close_if_idle()

    async def serve(
        self, requests: AsyncIterator[engine_pb2.PushKVStreamRequest]
    ) -> AsyncIterator[engine_pb2.PushKVStreamResponse]:
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        try:
            while (message := await self._out.take()) is not None:
                yield message
        finally:
            # The sender went away or the stream broke: every open push breaks off.
            reader.cancel()
            tasks = [push.task for push in self._pushes.values() if push.task is not None]
            for push in self._pushes.values():
                push.break_off()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[engine_pb2.PushKVStreamRequest]) -> None:
        try:
            async for message in requests:
                for entry in message.entries:
                    self._take(entry)
        finally:
            self._is_reading = False
            # No more entries can come: pushes still open end where their chunks did (as a
            # PushKV call whose sender half-closed).
            for push in self._pushes.values():
                push.entries.put_nowait(_END)
            self._close_if_idle()

    def _take(self, entry: engine_pb2.PushKVStreamEntry) -> None:
        push_id = entry.push_id
        kind = entry.WhichOneof("payload")
        push = self._pushes.get(push_id)
        if kind == "header":
            if push is not None:  # two pushes under one id could not be told apart
                self._end(push_id, push)
                self._fail(push_id, grpc.StatusCode.ALREADY_EXISTS,
                           f"push {push_id} is already open on this stream")
                return
            if self._is_draining:
                self._fail(push_id, grpc.StatusCode.UNAVAILABLE, "the receiver is draining")
                return
            push = self._pushes[push_id] = _OpenPush()
            push.task = asyncio.get_running_loop().create_task(
                self._run(push_id, push, entry.header))
        elif push is None:
            return  # a push that has ended (refused, cancelled): what was in flight is dropped
        elif kind == "chunk":
            push.entries.put_nowait(entry.chunk)
        elif kind == "end":
            push.entries.put_nowait(_END)
        elif kind == "cancel":
            self._end(push_id, push)
        else:
            self._end(push_id, push)
            self._fail(push_id, grpc.StatusCode.INVALID_ARGUMENT,
                       "a PushKVStream entry must carry a header, a chunk, end or cancel")

    def _end(self, push_id: int, push: _OpenPush) -> None:
        """Breaks `push` off (its task aborts the reservation); it answers nothing more."""
        del self._pushes[push_id]
        push.break_off()

    async def _run(self, push_id: int, push: _OpenPush, header: engine_pb2.KVPushHeader) -> None:
        push.has_begun = True
        try:
            done = await self._serve(header, push.chunks())
        except asyncio.CancelledError:
            raise
        except _GivenUp:
            pass  # broken off before it began: serve aborted what it had claimed
        except EngineError as error:
            if self._pushes.get(push_id) is push:
                self._fail(push_id, status_code_for(error), str(error) or type(error).__name__)
        except Exception:  # noqa: BLE001 - one push's failure must not end the stream
            logger.exception("PushKVStream: push %d failed", push_id)
            if self._pushes.get(push_id) is push:
                self._fail(push_id, grpc.StatusCode.INTERNAL, "internal error")
        else:
            if self._pushes.get(push_id) is push:
                self._out.add(push_id=push_id, done=done)
        finally:
            if self._pushes.get(push_id) is push:
                del self._pushes[push_id]
            self._close_if_idle()

    def _fail(self, push_id: int, code: grpc.StatusCode, message: str) -> None:
        self._out.add(push_id=push_id, error=engine_pb2.GenerateError(
            code=code.value[0], message=message))

    def _close_if_idle(self) -> None:
        if (not self._is_reading or self._is_draining) and not self._pushes:
            self._out.close()


def _id_of(result: engine_pb2.PushKVResult) -> str:
    return str(result.push_id)


def _batched(messages: list[engine_pb2.PushKVStreamRequest]) -> engine_pb2.PushKVStreamRequest:
    return engine_pb2.PushKVStreamRequest(
        entries=[entry for message in messages for entry in message.entries])


def _entry(push_id: int, **payload: Any) -> engine_pb2.PushKVStreamRequest:
    return engine_pb2.PushKVStreamRequest(
        entries=[engine_pb2.PushKVStreamEntry(push_id=push_id, **payload)])


class PushStreamError(Exception):
    """The receiver refused or failed a streamed push: PushKV's status code and message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Result:
    """Where a push's result arrives (MultiplexedCall's sink)."""

    def __init__(self) -> None:
        self.future: asyncio.Future[engine_pb2.PushKVResult] = \
            asyncio.get_running_loop().create_future()

    def deliver(self, entry: engine_pb2.PushKVResult) -> bool:
        if not self.future.done():
            self.future.set_result(entry)
        return True

    def fail(self, error: aio.AioRpcError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class PushStream:
    """The sending end of one peer's PushKVStream (opened on its first push, again after
    it broke)."""

    def __init__(self, channel: aio.Channel) -> None:
        self._open = channel.stream_stream(
            PUSH_KV_STREAM_METHOD,
            request_serializer=engine_pb2.PushKVStreamRequest.SerializeToString,
            response_deserializer=engine_pb2.PushKVStreamResponse.FromString,
        )
        self._call: MultiplexedCall[engine_pb2.PushKVStreamResponse,
                                    engine_pb2.PushKVResult] | None = None
        self._ids = itertools.count(1)

    def _usable_call(self) -> MultiplexedCall[engine_pb2.PushKVStreamResponse,
                                              engine_pb2.PushKVResult]:
        call = self._call
        if call is None or not call.is_usable():
            call = self._call = MultiplexedCall(
                self._open(), lambda message: message.results, _id_of, batch=_batched)
        return call

    async def push(
        self,
        header: engine_pb2.KVPushHeader,
        chunks: AsyncIterator[KVChunk],
        owed: Callable[[], None],
        not_owed: Callable[[], None],
    ) -> engine_pb2.PushKVResponse:
        """One push of chunks already in the receiver's stage: the header, each chunk's
        window as the engine exports it, then `end`; returns the receiver's result. The
        header's write is waited for (it claims the reservation before the engine computes);
        the windows and `end` are queued without waiting, in order, so what the engine
        exports back to back goes out in one message and nothing waits a writer's turn per
        entry. `owed` is called as the header is handed to the stream and as `end` is (from
        then the receiver owes the push: a receiver that stalled earlier is caught there),
        `not_owed` once the header is written (the engine's turn). Raises PushStreamError
        (the receiver's refusal), AioRpcError (the stream broke) or what `chunks` raised;
        giving up writes `cancel`."""
        call = self._usable_call()
        push_id = next(self._ids)
        key = str(push_id)
        result = _Result()
        try:
            owed()
            await call.start(key, _entry(push_id, header=header), result)
            not_owed()
            async for chunk in chunks:
                if result.future.done():  # refused early, or the stream broke: moot now
                    break
                call.write_nowait(_entry(push_id, chunk=engine_pb2.KVChunkData(
                    begin=chunk.begin, num_tokens=chunk.num_tokens)))
            else:
                owed()
                call.write_nowait(_entry(push_id, end=engine_pb2.KVPushEnd()))
            entry = await result.future
        except BaseException:
            call.cancel(key, _entry(push_id, cancel=engine_pb2.KVPushCancel()))
            raise
        if entry.WhichOneof("outcome") == "done":
            return entry.done
        code = _CODES.get(entry.error.code, grpc.StatusCode.UNKNOWN)
        raise PushStreamError(code, entry.error.message)

    async def close(self) -> None:
        if self._call is not None:
            await self._call.close()
            self._call = None
