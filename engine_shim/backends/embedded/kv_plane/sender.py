"""The sending side of the KV data plane: pooled channels to peer shims (built with
microserving.transport, so TLS and the token apply) and the PushKV client stream, which
carries the KV bytes or, when they went through the receiver's shared-memory stage, only
each chunk's window; such a staged push goes on the peer's PushKVStream instead where the
receiver offers one (push_stream.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio

from engine_shim.backends.embedded.kv_plane.addr import KVAddrInfo
from engine_shim.backends.embedded.kv_plane.codec import (
    bytes_per_token,
    encode_chunk_request,
    split_chunk,
)
from engine_shim.backends.embedded.kv_plane.push_stream import PushStream, PushStreamError
from engine_shim.convert import layout_to_pb
from engine_shim.engine.api import (
    EngineError,
    FailedPreconditionError,
    InvalidRequestError,
    KVChunk,
    NotFoundError,
    UnavailableError,
)
from microserving.transport import FAULT_RECEIVER, TransportSettings, create_channel
from microserving.v1 import engine_pb2, engine_pb2_grpc


class ReceiverUnavailableError(UnavailableError):
    """The receiving shim could not be reached, or failed, during a KV transfer: RemoteSend
    then ends UNAVAILABLE with trailing metadata naming the receiver as the one at fault
    (FAULT_METADATA_KEY), so a router takes the receiver out of rotation, not this engine."""

    fault = FAULT_RECEIVER


PEER_ERRORS: dict[grpc.StatusCode, type[EngineError]] = {
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
}


_PUSH_KV_METHOD = "/microserving.v1.KVTransfer/PushKV"
# A push still running on an evicted channel gets this long to finish.
_CLOSE_GRACE_S = 30.0


def _pass_through(message: bytes) -> bytes:
    return message


@dataclass
class _Peer:
    """A peer's channel, its PushKV callable (pre-encoded bytes out), its PushKVStream and
    the generated KVTransfer stub for the rest (made on first use)."""

    channel: aio.Channel
    push: aio.StreamUnaryMultiCallable
    kv: engine_pb2_grpc.KVTransferStub | None = None
    stream: PushStream | None = None


class PeerChannels:
    """One channel per peer address, reused by every transfer to that peer (PushKV and the
    WriteKV handshake of NIXL writes); at most `max_channels`, the least recently used closed
    first (peers come and go with the deployment). Requests go out as pre-encoded protobuf
    bytes (kv_plane.codec.encode_chunk_request)."""

    def __init__(self, transport: TransportSettings, max_channels: int = 64) -> None:
        self._transport = transport
        self._max_channels = max_channels
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def num_channels(self) -> int:
        return len(self._peers)

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.pop(address, None)
        if peer is None:
            channel = create_channel(address, self._transport)
            peer = _Peer(channel, channel.stream_unary(
                _PUSH_KV_METHOD,
                request_serializer=_pass_through,
                response_deserializer=engine_pb2.PushKVResponse.FromString,
            ))
        self._peers[address] = peer  # most recently used last
        while len(self._peers) > self._max_channels:
            _, oldest = self._peers.popitem(last=False)
            task = asyncio.ensure_future(oldest.channel.close(grace=_CLOSE_GRACE_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return peer

    def stub(self, address: str) -> aio.StreamUnaryMultiCallable:
        return self._peer(address).push

    def push_stream(self, address: str) -> PushStream:
        """The peer's PushKVStream (push_stream.py), for pushes through its stage."""
        peer = self._peer(address)
        if peer.stream is None:
            peer.stream = PushStream(peer.channel)
        return peer.stream

    def _kv(self, address: str) -> engine_pb2_grpc.KVTransferStub:
        peer = self._peer(address)
        if peer.kv is None:
            peer.kv = engine_pb2_grpc.KVTransferStub(peer.channel)
        return peer.kv

    def write_stub(self, address: str) -> aio.UnaryStreamMultiCallable:
        """KVTransfer.WriteKV of the peer (the handshake of a NIXL write)."""
        return self._kv(address).WriteKV  # type: ignore[return-value]

    def hold_stub(self, address: str) -> aio.UnaryStreamMultiCallable:
        """KVTransfer.HoldKV of the peer (hold.py)."""
        return self._kv(address).HoldKV  # type: ignore[return-value]

    def abandon_stub(self, address: str) -> aio.UnaryUnaryMultiCallable:
        """KVTransfer.AbandonKVWrite of the peer (nixl_sender.py)."""
        return self._kv(address).AbandonKVWrite  # type: ignore[return-value]

    async def close(self) -> None:
        for peer in self._peers.values():
            if peer.stream is not None:
                await peer.stream.close()
            await peer.channel.close()
        self._peers.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)


class _Progress:
    """What the request stream saw: bytes sent, the engine's error if it raised one, and since
    when the push has waited on the receiver (a message gRPC has not taken yet, or, after the
    last, the answer; None while it waits on its own engine for the next chunk)."""

    def __init__(self) -> None:
        self.num_bytes = 0
        self.error: BaseException | None = None
        self.receiver_owes_since: float | None = None

    def owes(self) -> None:
        self.receiver_owes_since = time.monotonic()

    def owed(self, message: bytes) -> bytes:
        """`message`, which the receiver owes from now (until gRPC takes it)."""
        self.owes()
        return message

    def paid(self) -> None:
        self.receiver_owes_since = None


def _header(addr: KVAddrInfo) -> engine_pb2.KVPushHeader:
    """A push's header: the reservation `addr` names and its layout."""
    return engine_pb2.KVPushHeader(
        request_id=addr.request_id,
        reservation_token=addr.reservation_token,
        layout=layout_to_pb(addr.layout),
    )


async def _messages(
    addr: KVAddrInfo,
    chunks: AsyncIterator[KVChunk],
    max_payload_bytes: int,
    is_staged: bool,
    progress: _Progress,
) -> AsyncIterator[bytes]:
    header = _header(addr)
    # gRPC takes the next message once the previous one is written (the receiver's flow
    # control lets it through): from each yield until then the receiver owes the push.
    yield progress.owed(engine_pb2.PushKVRequest(header=header).SerializeToString())
    try:
        while True:
            progress.receiver_owes_since = None  # the engine's turn: its next chunk
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            if is_staged:  # already in the receiver's stage: only the window goes out
                progress.num_bytes += chunk.num_tokens * bytes_per_token(addr.layout)
                yield progress.owed(encode_chunk_request(chunk.begin, chunk.num_tokens, b""))
                continue
            for begin, num_tokens, raw in split_chunk(chunk, max_payload_bytes):
                progress.num_bytes += len(raw)
                yield progress.owed(encode_chunk_request(begin, num_tokens, raw))
    except Exception as error:  # noqa: BLE001 - re-raised by push_kv after the call ends
        # Ending the stream early makes the receiver drop the incomplete reservation.
        progress.error = error
    progress.owed(b"")  # the last message is out: the answer is the receiver's


async def push_kv(
    peers: PeerChannels,
    addr: KVAddrInfo,
    chunks: AsyncIterator[KVChunk],
    *,
    max_payload_bytes: int,
    is_staged: bool = False,
    timeout_s: float | None = None,
    stall_timeout_s: float | None = None,
    streamed: bool = False,
) -> tuple[int, int]:
    """Stream `chunks` into the reservation `addr` names; returns (tokens, bytes) written.
    `is_staged`: the chunks were exported into the receiver's shared-memory stage, so their
    messages carry windows only (shm.py). `timeout_s` bounds the whole push, the engine's
    queue included; `stall_timeout_s` the receiver's part alone: a receiver that takes no
    message (or, after the last, gives no answer) for that long, one stopped or hung, ends the
    push with ReceiverUnavailableError, where it would otherwise hold it until `timeout_s`.
    `streamed`: a staged push goes on the peer's PushKVStream (which its kv_addr_info
    offered) instead of a PushKV call of its own."""
    if streamed and is_staged:
        return await _push_streamed(peers, addr, chunks, timeout_s, stall_timeout_s)
    progress = _Progress()
    stub = peers.stub(addr.address)
    messages = _messages(addr, chunks, max_payload_bytes, is_staged, progress)
    call = stub(messages, timeout=timeout_s)
    watch = None if stall_timeout_s is None else \
        asyncio.ensure_future(_watch_receiver(call, progress, stall_timeout_s))
    try:
        response: engine_pb2.PushKVResponse = await call
    except (aio.AioRpcError, asyncio.CancelledError) as error:
        # The watch cancels the call locally, which gRPC raises as CancelledError; one that
        # reaches this task from outside stays a cancellation.
        stalled = _has_stalled(watch)
        if isinstance(error, asyncio.CancelledError) and (not stalled or _is_cancelling()):
            raise
        if progress.error is not None:  # the engine failed first: its error, not the stall
            raise progress.error from None
        if stalled:
            raise _stall_error(addr, stall_timeout_s) from None
        assert isinstance(error, aio.AioRpcError)
        error_type = PEER_ERRORS.get(error.code(), ReceiverUnavailableError)
        raise error_type(f"KV push to {addr.address} failed: {error.details()}") from None
    finally:
        if watch is not None:
            watch.cancel()
        await _close(chunks)
    if progress.error is not None:
        raise progress.error
    return response.num_tokens_written, response.num_bytes_written


async def _push_streamed(
    peers: PeerChannels,
    addr: KVAddrInfo,
    chunks: AsyncIterator[KVChunk],
    timeout_s: float | None,
    stall_timeout_s: float | None,
) -> tuple[int, int]:
    """push_kv's staged push on the peer's PushKVStream, with the same bounds and errors."""
    progress = _Progress()
    body = asyncio.ensure_future(
        peers.push_stream(addr.address).push(_header(addr), chunks, progress.owes, progress.paid))
    watch = None if stall_timeout_s is None else \
        asyncio.ensure_future(_watch_receiver(body, progress, stall_timeout_s))
    try:
        async with asyncio.timeout(timeout_s):
            response = await body
    except asyncio.CancelledError:
        # The watch cancelled the push (a stall); one that reaches this task from outside
        # stays a cancellation.
        if not _has_stalled(watch) or _is_cancelling():
            raise
        raise _stall_error(addr, stall_timeout_s) from None
    except TimeoutError:
        raise ReceiverUnavailableError(
            f"KV push to {addr.address} failed: not done within {timeout_s:g} s") from None
    except PushStreamError as error:
        error_type = PEER_ERRORS.get(error.code, ReceiverUnavailableError)
        raise error_type(f"KV push to {addr.address} failed: {error.details}") from None
    except aio.AioRpcError as error:  # the stream broke
        raise ReceiverUnavailableError(f"KV push to {addr.address} failed: {error.details()}") from None
    finally:
        if watch is not None:
            watch.cancel()
        await _close(chunks)
    return response.num_tokens_written, response.num_bytes_written


def _has_stalled(watch: asyncio.Future[bool] | None) -> bool:
    """Whether the stall watch ended the push."""
    return watch is not None and watch.done() and not watch.cancelled() and watch.result()


def _is_cancelling() -> bool:
    """Whether this task is being cancelled from outside (not by the watch)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _stall_error(addr: KVAddrInfo, stall_timeout_s: float | None) -> ReceiverUnavailableError:
    return ReceiverUnavailableError(
        f"KV push to {addr.address} failed: the receiver took nothing for {stall_timeout_s:g} s")


async def _watch_receiver(
    call: aio.StreamUnaryCall | asyncio.Future[Any], progress: _Progress, stall_s: float,
) -> bool:
    """Cancels `call` once its receiver has owed it for `stall_s`; True if it did. Checks a
    few times a stall's length (one timer a push, not one per message)."""
    interval_s = max(0.05, stall_s / 4)
    while not call.done():
        await asyncio.sleep(interval_s)
        since = progress.receiver_owes_since
        if since is not None and time.monotonic() - since >= stall_s and not call.done():
            call.cancel()
            return True
    return False


async def _close(chunks: AsyncIterator[KVChunk]) -> None:
    """Ends the engine's export (which releases its pages). When the receiver refused the
    push early, gRPC's request-writing task may still be suspended inside the chunks; gRPC
    cancels that task as the call ends, and the cancel closes them there."""
    with contextlib.suppress(RuntimeError):  # "asynchronous generator is already running"
        await chunks.aclose()  # type: ignore[attr-defined]
