"""The receiving side of the KV data plane: the KVTransfer servicer that checks a push's
layout and window against its reservation (reservations.py) and writes its chunks into the
engine, from the message bytes or, for a chunk that carries none, from the reservation's
shared-memory stage. A push that breaks off aborts its reservation. A push comes as a PushKV
call of its own or on a sender's PushKVStream (push_stream.py); both run `serve_push`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol, cast

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from engine_shim.backend import HoldListener
from engine_shim.backends.embedded.kv_plane.codec import (
    bytes_per_token,
    check_layout,
    chunk_from_bytes,
    decode_chunk_request,
)
from engine_shim.backends.embedded.kv_plane.hold import serve_hold
from engine_shim.backends.embedded.kv_plane.nixl_receiver import KVWriteSink, receive_write
from engine_shim.backends.embedded.kv_plane.push_stream import ChunkFields, StreamedPushes
from engine_shim.backends.embedded.kv_plane.reservations import ReceiveTable, Ticket
from engine_shim.backends.embedded.kv_plane.shm import staged_slice
from engine_shim.convert import layout_from_pb
from engine_shim.engine.api import InvalidRequestError, KVChunk, KVLayout, NotFoundError
from engine_shim.errors import map_errors
from microserving.v1 import engine_pb2, engine_pb2_grpc

if TYPE_CHECKING:
    from engine_shim.backends.embedded.kv_plane.nixl import KVWritePlane

KV_TRANSFER_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name


class KVSink(Protocol):
    @property
    def kv_layout(self) -> KVLayout:
        """The receiver's layout; raises UnavailableError while the engine loads."""
        ...

    async def import_kv(self, request_id: str, chunk: KVChunk) -> None: ...

    async def hold_reservation(self, request_id: str, is_held: bool) -> None: ...

    async def abort(self, request_id: str) -> bool: ...


def _parse_request(raw: bytes) -> engine_pb2.PushKVRequest:
    try:
        return engine_pb2.PushKVRequest.FromString(raw)
    except DecodeError:
        raise InvalidRequestError("a PushKV message is not a valid PushKVRequest") from None


def _chunk_fields(raw: bytes) -> ChunkFields:
    """(begin, num_tokens, data) of a chunk message: by the copy-free decoder, or, for any
    encoding it leaves alone, by the protobuf runtime."""
    fields = decode_chunk_request(raw)
    if fields is not None:
        return fields
    message = _parse_request(raw)
    if message.WhichOneof("payload") != "chunk":
        raise InvalidRequestError("only chunks may follow the PushKV header")
    return message.chunk.begin, message.chunk.num_tokens, message.chunk.data


class KVTransferServicer(engine_pb2_grpc.KVTransferServicer):
    """Receives PushKV streams as the raw bytes of each message (see `add_to_server`), and
    WriteKV handshakes and HoldKV holds of NIXL writes (nixl_receiver.py, hold.py)."""

    def __init__(
        self,
        table: ReceiveTable,
        sink: KVSink,
        nixl: Callable[[], KVWritePlane | None] = lambda: None,
        on_hold: HoldListener | None = None,
    ) -> None:
        self._table = table
        self._sink = sink
        self._nixl = nixl  # this shim's NIXL agent, if it has one
        self._on_hold = on_hold
        self._streams: set[StreamedPushes] = set()  # the PushKVStreams being served
        self._is_draining = False

    async def _hold(self, request_id: str, is_held: bool) -> None:
        await self._sink.hold_reservation(request_id, is_held)
        if self._on_hold is not None:
            self._on_hold(request_id, is_held)

    def add_to_server(self, server: aio.Server) -> None:
        """Registers KVTransfer like the generated `add_KVTransferServicer_to_server`, except
        that PushKV's messages arrive undeserialised: `_chunk_fields` reads the KV payload as
        a view of gRPC's buffer instead of the runtime's two copies of it."""
        handler = grpc.stream_unary_rpc_method_handler(
            self.PushKV,
            request_deserializer=None,  # bytes as received
            response_serializer=engine_pb2.PushKVResponse.SerializeToString,
        )
        write_handler = grpc.unary_stream_rpc_method_handler(
            self.WriteKV,
            request_deserializer=engine_pb2.WriteKVRequest.FromString,
            response_serializer=engine_pb2.WriteKVResponse.SerializeToString,
        )
        hold_handler = grpc.unary_stream_rpc_method_handler(
            self.HoldKV,
            request_deserializer=engine_pb2.HoldKVRequest.FromString,
            response_serializer=engine_pb2.HoldKVResponse.SerializeToString,
        )
        abandon_handler = grpc.unary_unary_rpc_method_handler(
            self.AbandonKVWrite,
            request_deserializer=engine_pb2.AbandonKVWriteRequest.FromString,
            response_serializer=engine_pb2.AbandonKVWriteResponse.SerializeToString,
        )
        stream_handler = grpc.stream_stream_rpc_method_handler(
            self.PushKVStream,
            request_deserializer=engine_pb2.PushKVStreamRequest.FromString,
            response_serializer=engine_pb2.PushKVStreamResponse.SerializeToString,
        )
        handlers = {"PushKV": handler, "PushKVStream": stream_handler, "WriteKV": write_handler,
                    "HoldKV": hold_handler, "AbandonKVWrite": abandon_handler}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(KV_TRANSFER_SERVICE, handlers),)
        )

    @map_errors
    async def WriteKV(
        self, request: engine_pb2.WriteKVRequest, context: aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.WriteKVResponse]:
        sink = cast(KVWriteSink, self._sink)
        async for event in receive_write(request, self._table, self._nixl(), sink, self._on_hold):
            yield event

    @map_errors
    async def AbandonKVWrite(
        self, request: engine_pb2.AbandonKVWriteRequest, context: aio.ServicerContext
    ) -> engine_pb2.AbandonKVWriteResponse:
        self._table.abandon(request.request_id, request.reservation_token, request.sender_agent)
        return engine_pb2.AbandonKVWriteResponse()

    @map_errors
    async def HoldKV(
        self, request: engine_pb2.HoldKVRequest, context: aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.HoldKVResponse]:
        async for event in serve_hold(request, self._table, self._sink.hold_reservation, self._on_hold):
            yield event

    @map_errors
    async def PushKV(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[bytes],
        context: aio.ServicerContext,
    ) -> engine_pb2.PushKVResponse:
        messages = aiter(request_iterator)
        raw_first = await anext(messages, None)
        first = None if raw_first is None else _parse_request(raw_first)
        if first is None or first.WhichOneof("payload") != "header":
            raise InvalidRequestError("a PushKV stream must start with its header")
        return await self.serve_push(first.header, (_chunk_fields(raw) async for raw in messages))

    async def PushKVStream(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[engine_pb2.PushKVStreamRequest],
        context: aio.ServicerContext,
    ) -> AsyncIterator[engine_pb2.PushKVStreamResponse]:
        # Each push's errors travel in its result (push_stream.py): nothing here to map.
        pushes = StreamedPushes(self.serve_push)
        if self._is_draining:
            pushes.drain()
        self._streams.add(pushes)
        try:
            async for message in pushes.serve(request_iterator):
                yield message
        finally:
            self._streams.discard(pushes)

    def drain(self) -> None:
        """Shutting down: each PushKVStream refuses new pushes and ends once its open ones
        have (its sender opens a new stream, on another receiver or on this one restarted)."""
        self._is_draining = True
        for pushes in self._streams:
            pushes.drain()

    async def serve_push(
        self, header: engine_pb2.KVPushHeader, chunks: AsyncIterator[ChunkFields]
    ) -> engine_pb2.PushKVResponse:
        """One push, a PushKV call's or a PushKVStream's: checks its header against the
        reservation, writes its chunks into the engine in order and answers what was
        written. A push that breaks off (cancelled, invalid, its chunks ending short) aborts
        the reservation."""
        check_layout(layout_from_pb(header.layout), self._sink.kv_layout)
        ticket = self._table.claim(header.request_id, header.reservation_token)
        try:
            # The sender opens the push before it computes the KV: from here the reservation
            # lives as long as the push, however long the sender's queue.
            await self._hold(header.request_id, True)
            num_bytes = await self._receive(header.request_id, ticket, chunks)
            try:
                await self._hold(header.request_id, False)
            except NotFoundError:
                # A start waiting in the engine for this KV (after_kv) took the reservation
                # with the last chunk; one aborted meanwhile has its ticket closed too.
                if not self._table.is_open(header.request_id, ticket):
                    raise
        except BaseException:
            # Broken off, cancelled or invalid: nothing stays reserved.
            self._table.close(header.request_id)
            await self._sink.abort(header.request_id)
            raise
        self._table.finish(ticket)
        return engine_pb2.PushKVResponse(
            num_tokens_written=ticket.end - ticket.begin, num_bytes_written=num_bytes
        )

    async def _receive(
        self, request_id: str, ticket: Ticket, chunks: AsyncIterator[ChunkFields]
    ) -> int:
        position, num_bytes = ticket.begin, 0
        # One import in flight while the next chunk is read: the engine thread writes
        # chunk i into the pool while gRPC delivers chunk i+1 (the engine runs commands in
        # order, so chunks land in order).
        importing: asyncio.Future[None] | None = None
        try:
            async for fields in chunks:
                position, num_bytes, importing = await self._accept(
                    request_id, ticket, fields, position, num_bytes, importing
                )
            if importing is not None:
                await importing
                importing = None
        finally:
            if importing is not None:
                importing.cancel()
        if position != ticket.end:
            raise InvalidRequestError(f"KV push ended at {position}, reservation ends {ticket.end}")
        return num_bytes

    async def _accept(
        self, request_id: str, ticket: Ticket, fields: ChunkFields,
        position: int, num_bytes: int, importing: asyncio.Future[None] | None,
    ) -> tuple[int, int, asyncio.Future[None]]:
        """Check one chunk, wait for the previous import, start this one's."""
        begin, num_tokens, data = fields
        if begin != position or begin + num_tokens > ticket.end:
            raise InvalidRequestError(
                f"chunk [{begin}, {begin + num_tokens}) does not continue "
                f"the reserved window at {position} (end {ticket.end})"
            )
        kv = self._chunk(ticket, begin, num_tokens, data)
        if importing is not None:
            await importing
        next_import = asyncio.ensure_future(self._sink.import_kv(request_id, kv))
        num_bytes += num_tokens * bytes_per_token(self._sink.kv_layout)
        return position + num_tokens, num_bytes, next_import

    def _chunk(
        self, ticket: Ticket, begin: int, num_tokens: int, data: bytes | memoryview
    ) -> KVChunk:
        """The chunk's KV: its bytes, or, when it carries none, its window of the
        reservation's shared-memory stage (where the sender has already written it)."""
        layout = self._sink.kv_layout
        if len(data) or num_tokens < 1:
            return chunk_from_bytes(begin, num_tokens, data, layout)
        if ticket.staging is None:
            raise InvalidRequestError(
                "a KV chunk without bytes needs the reservation's shared-memory segment, "
                "and it has none (not offered, or the reservation was closed)"
            )
        # By reference: an engine core in its own process reads the stage itself.
        staged = staged_slice(ticket.staging, ticket.begin, begin, num_tokens, layout)
        return KVChunk(begin=begin, num_tokens=num_tokens, data=staged)
