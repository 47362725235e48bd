"""KVTransfer.HoldKV, both sides: a one-sided (NIXL) sender whose engine may queue the send
for longer than the receiver's reservation lives keeps it alive with a hold; the receiver
keeps the reservation (its ticket and the engine's pages) from expiring while any hold is
open. A sender whose agent sits beside the engine core claims the reservation (WriteKV) as
its RemoteSend begins, and an open claim holds it too, so it opens a hold only when that
claim is given up as its deadline nears with the KV not yet computed (nixl_sender.py); one
that claims only once the KV is computed holds from the start. A PushKV claims at once by itself and needs none."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc
from grpc import aio

from engine_shim.backends.embedded.kv_plane.addr import KVAddrInfo
from engine_shim.engine.api import NotFoundError
from microserving.v1 import engine_pb2

logger = logging.getLogger(__name__)

# The receiver ends a hold after this long, whatever the sender's deadline says.
MAX_HOLD_S = 600.0

HoldFn = Callable[[str, bool], Awaitable[None]]


class HoldTable(Protocol):
    """The receiver's reservations (reservations.ReceiveTable)."""

    def hold(self, request_id: str, token: str) -> Any: ...

    def let_go(self, request_id: str, ticket: Any) -> bool: ...


HoldStub = Callable[[str], aio.UnaryStreamMultiCallable]


async def serve_hold(
    request: engine_pb2.HoldKVRequest, table: HoldTable, hold: HoldFn,
    on_hold: Callable[[str, bool], None] | None = None,
) -> AsyncIterator[engine_pb2.HoldKVResponse]:
    """HoldKV's one event, `held`; then the hold lasts until the call ends (cancelled by the
    sender, its deadline, or MAX_HOLD_S). A reservation the engine holds with no TTL of its
    own (the ticket's is the only one) is held here alone: no engine round trip. `on_hold`
    (the shim's own view of its reservations, requests.RequestTracker, which counts the holds
    open) is told of both ends: a start that comes during a long hold (after the sender's
    queue, with the first tokens it sampled) finds the reservation live."""
    request_id = request.request_id
    ticket = table.hold(request_id, request.reservation_token)
    is_engine_held = False
    if on_hold is not None:
        on_hold(request_id, True)
    try:
        if not ticket.engine_held:
            await hold(request_id, True)
            ticket.num_engine_holds += 1
            is_engine_held = True
        yield engine_pb2.HoldKVResponse(held=engine_pb2.KVHeld())
        await asyncio.sleep(MAX_HOLD_S)
    finally:
        if is_engine_held and ticket.num_engine_holds > 0:  # before the let-go below, which
            ticket.num_engine_holds -= 1  # may end the engine's hold (a write's end did)
        # The engine's copy is let go only when no write fills the reservation now and no
        # other hold is open; a reservation consumed or aborted meanwhile has nothing to let go.
        if on_hold is not None:
            on_hold(request_id, False)
        if table.let_go(request_id, ticket) and not ticket.engine_held:
            with contextlib.suppress(NotFoundError):
                await hold(request_id, False)


class Hold:
    """A sender's HoldKV on `addr`'s reservation: `open()` sends it (nothing awaited, so it
    costs the send no round trip; opening twice is a no-op), `close()` ends it (idempotent).
    A receiver that cannot hold (reservation gone, an older shim) is only logged: the
    write's own claim then reports what is wrong."""

    def __init__(self, stub: HoldStub, addr: KVAddrInfo, timeout_s: float) -> None:
        self._stub = stub
        self._addr = addr
        self._timeout_s = timeout_s
        self._call: aio.UnaryStreamCall | None = None
        self._watcher: asyncio.Future[None] | None = None

    def open(self) -> None:
        if self._call is not None:
            return
        addr = self._addr
        request = engine_pb2.HoldKVRequest(
            request_id=addr.request_id, reservation_token=addr.reservation_token
        )
        self._call = self._stub(addr.address)(request, timeout=self._timeout_s)
        self._watcher = asyncio.ensure_future(_watch(self._call, addr))

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._call is not None:
            self._call.cancel()


@contextlib.asynccontextmanager
async def holding(stub: HoldStub, addr: KVAddrInfo, timeout_s: float) -> AsyncIterator[None]:
    """Hold `addr`'s reservation while the body runs (Hold, opened as the body starts)."""
    hold = Hold(stub, addr, timeout_s)
    hold.open()
    try:
        yield
    finally:
        hold.close()


async def _watch(call: aio.UnaryStreamCall, addr: KVAddrInfo) -> None:
    try:
        event = await call.read()
    except aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.CANCELLED:
            logger.info("no hold on %s's reservation at %s: %s %s", addr.request_id,
                        addr.address, error.code().name, error.details())
        return
    if event is aio.EOF or event.WhichOneof("event") != "held":
        logger.info("no hold on %s's reservation at %s", addr.request_id, addr.address)
