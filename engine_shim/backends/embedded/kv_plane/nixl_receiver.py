"""The receiving side of a NIXL write (KVTransfer.WriteKV): claim the reservation for the
sender's agent, tell the sender to write, complete the reservation on the agent's
notification. A call that ends any other way aborts the reservation; the engine then holds
its pages back until the sender's declared write deadline has passed
(disaggregation.begin_kv_write), so a late write cannot land in reused pages."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from engine_shim.backends.embedded.kv_plane.codec import check_layout
from engine_shim.backends.embedded.kv_plane.nixl import KVWritePlane
from engine_shim.backends.embedded.kv_plane.reservations import ReceiveTable
from engine_shim.convert import layout_from_pb
from engine_shim.engine.api import InvalidRequestError, KVLayout, UnavailableError
from microserving.v1 import engine_pb2

# A sender may not declare a longer write than this (its pages would be fenced as long).
MAX_WRITE_DEADLINE_MS = 120_000


class KVWriteSink(Protocol):
    @property
    def kv_layout(self) -> KVLayout: ...

    async def begin_kv_write(self, request_id: str, write_ends_at: float) -> None: ...

    def submit_begin_kv_write(self, request_id: str, write_ends_at: float) -> None:
        """begin_kv_write without waiting for it: the engine runs it before any call made
        after this one."""
        ...

    async def finish_kv_write(self, request_id: str) -> None: ...

    async def cancel_kv_write(self, request_id: str, is_held: bool) -> None: ...

    async def abort(self, request_id: str) -> bool: ...


async def receive_write(
    request: engine_pb2.WriteKVRequest,
    table: ReceiveTable,
    plane: KVWritePlane | None,
    sink: KVWriteSink,
    on_hold: Callable[[str, bool], None] | None = None,
) -> AsyncIterator[engine_pb2.WriteKVResponse]:
    """WriteKV's events: ready, then done. The engine holds the reservation from
    begin_kv_write to finish_kv_write (one call each, and an agent beside the engine core
    makes the second itself on the notification: a write then costs the receiver's engine
    one round trip, the claim's, and none while a HoldKV the engine confirmed holds the
    reservation); `on_hold` is told of both ends, like the holds of PushKV. The write
    deadline still bounds the wait. A claim its sender abandons (AbandonKVWrite: it wrote
    nothing) ends the call without `done` and leaves the reservation open, unfenced."""
    if plane is None:
        raise InvalidRequestError("this shim offers no NIXL writes (see --kv-transport)")
    if not 0 < request.write_deadline_ms <= MAX_WRITE_DEADLINE_MS:
        raise InvalidRequestError(f"write_deadline_ms must be in (0, {MAX_WRITE_DEADLINE_MS}]")
    write_ends_at = time.monotonic() + request.write_deadline_ms / 1e3
    check_layout(layout_from_pb(request.layout), sink.kv_layout)
    ticket = table.claim_write(request.request_id, request.reservation_token, request.sender_agent)
    abandoned = ticket.abandoned
    assert abandoned is not None
    tag = request.reservation_token.encode()
    try:
        if ticket.write_digest is None or not secrets.compare_digest(
            ticket.write_digest, request.offer_digest
        ):
            raise InvalidRequestError("the write offer quoted is not the one this reservation made")
        if ticket.num_engine_holds or ticket.engine_held:
            # The engine's reservation cannot expire (a confirmed hold, or it has no TTL of
            # its own: the ticket's, live here, is the only one), and anything that could end
            # it (an abort, another claim) comes after this in the engine's order and sees the
            # write begun (its pages fenced): so the sender can go ahead without the engine's
            # round trip, which under load waits for a whole step.
            sink.submit_begin_kv_write(request.request_id, write_ends_at)
        else:
            await sink.begin_kv_write(request.request_id, write_ends_at)
        # After the begin: an agent beside the engine core (CoreNixlPlane) then runs the
        # expect after the engine's begin_kv_write, so a notification it matches always
        # finds the write begun.
        landed = plane.expect(request.sender_agent, tag, request.request_id)
        if on_hold is not None:
            on_hold(request.request_id, True)
        yield engine_pb2.WriteKVResponse(ready=engine_pb2.KVWriteReady())
        await asyncio.wait({landed, abandoned}, timeout=max(0.0, write_ends_at - time.monotonic()),
                           return_when=asyncio.FIRST_COMPLETED)
        if not landed.done() and abandoned.done():
            # The sender wrote nothing (AbandonKVWrite): no fence, the reservation stays.
            plane.forget(tag)
            await sink.cancel_kv_write(request.request_id, ticket.num_holds > 0 or ticket.engine_held)
            table.unclaim(ticket)
            if on_hold is not None:
                on_hold(request.request_id, False)
            return
        if not landed.done():
            raise UnavailableError("the sender's KV write did not land by its deadline")
        landed.result()  # completing it in the engine may have failed
        if not plane.finishes_writes:  # else the agent's side completed it in the engine
            await sink.finish_kv_write(request.request_id)
        if on_hold is not None:
            on_hold(request.request_id, False)
    except BaseException:
        # Refused, broken off, cancelled or late: nothing stays reserved (pages fenced).
        plane.forget(tag)
        table.close(request.request_id)
        await sink.abort(request.request_id)
        raise
    table.finish(ticket)
    num_tokens = ticket.end - ticket.begin
    done = engine_pb2.PushKVResponse(
        num_tokens_written=num_tokens,
        num_bytes_written=plane.region.bytes_of(num_tokens),
    )
    yield engine_pb2.WriteKVResponse(done=done)
