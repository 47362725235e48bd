"""The sending side of a NIXL write: keeping the receiver's reservation alive however long
the engine queues the send (an open claim or a HoldKV, hold.py), and with the send's pages
held once computed, claim the receiver's reservation over KVTransfer.WriteKV (quoting the
offer it writes by and a deadline), write the pages straight into the reserved slots once
the receiver says ready, and return once it says the notification arrived. Writes go only
to an agent that this authenticated peer confirmed for this reservation, only into the
slots it reserved."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
from grpc import aio

from engine_shim.backends.embedded.kv_plane.addr import KVAddrInfo, NixlOffer
from engine_shim.backends.embedded.kv_plane.hold import Hold, holding
from engine_shim.backends.embedded.kv_plane.nixl import HeldSlots, KVWritePlane, WriteNotStarted
from engine_shim.backends.embedded.kv_plane.nixl_descs import segment_slots
from engine_shim.backends.embedded.kv_plane.sender import (
    PEER_ERRORS,
    PeerChannels,
    ReceiverUnavailableError,
)
from engine_shim.convert import layout_to_pb
from engine_shim.engine.api import UnavailableError
from engine_shim.engine.block_manager import Slots
from microserving.v1 import engine_pb2

logger = logging.getLogger(__name__)

# An abandon (AbandonKVWrite) and the receiver's end of the claim get this long each.
_ABANDON_TIMEOUT_S = 2.0


@dataclass
class _Marks:
    """When a claimed write's events came (perf_counter), as _claim_and_write saw them."""

    ready: float = 0.0
    written: float = 0.0
    done: float = 0.0


@dataclass
class WriteTimes:
    """Where a write's time went (ms): the engine holding the send's pages (its prefill, if
    any), the claim's round trip, the transfer, the receiver's confirmation."""

    hold_ms: float = 0.0
    accept_ms: float = 0.0  # of hold_ms: until the engine took the send (its call's round trip)
    claim_ms: float = 0.0
    transfer_ms: float = 0.0
    confirm_ms: float = 0.0

    def settle(self, started: float, computed: float, marks: _Marks) -> None:
        """The phases from the send's start, the KV computed and the write's events: a
        claim answered while the engine computed adds nothing, and the transfer counts from
        the later of the two."""
        self.hold_ms = (computed - started) * 1e3
        self.claim_ms = max(0.0, marks.ready - computed) * 1e3
        self.transfer_ms = max(0.0, marks.written - max(marks.ready, computed)) * 1e3
        self.confirm_ms = max(0.0, marks.done - marks.written) * 1e3

    def __str__(self) -> str:
        return (
            f"hold {self.hold_ms:.1f} (accepted at {self.accept_ms:.1f}), claim {self.claim_ms:.1f}, "
            f"transfer {self.transfer_ms:.1f}, confirm {self.confirm_ms:.1f} ms"
        )


async def write_kv(
    peers: PeerChannels,
    plane: KVWritePlane,
    addr: KVAddrInfo,
    held: AbstractAsyncContextManager[Slots | None],
    *,
    send_id: str,
    window_begin: int,
    write_timeout_s: float,
    hold_timeout_s: float = 300.0,
    times: WriteTimes | None = None,
) -> tuple[int, int]:
    """Write the held send's KV (slots of [window_begin, end)) into `addr`'s reservation;
    (tokens, bytes) written. `held` yields the send's slots once computed, or None where the
    plane reads them itself (KVWritePlane.reads_held_slots: the engine's send `send_id`).
    The receiver holds the reservation however long the engine queues the send (at most
    `hold_timeout_s`): under a HoldKV from the start; or, where the plane reads the slots
    itself (the agent beside the engine core), under the claim, which goes out at once (the
    write starts in the core the moment the KV is computed: _write_early), and a HoldKV only
    if the claim is given up as its deadline nears. Raises UnavailableError when the peer or
    its agent fails, or the write does not land within `write_timeout_s` of its claim."""
    offer = addr.nixl
    if offer is None:
        raise UnavailableError("the receiver made no NIXL offer")
    times = WriteTimes() if times is None else times
    await plane.load_peer(offer)
    started = time.perf_counter()
    offset = addr.begin - window_begin
    remote = segment_slots(addr.kv_segments)
    if plane.reads_held_slots:
        # The claim goes out now and holds the reservation while it is open; a hold only
        # if it is given up before the KV is computed (a send queued past its deadline).
        hold = Hold(peers.hold_stub, addr, hold_timeout_s)
        try:
            num_bytes = await _write_early(
                peers, plane, addr, offer, HeldSlots(send_id, offset), remote, held,
                write_timeout_s, times, started, hold,
            )
        finally:
            hold.close()
        return addr.end - addr.begin, num_bytes
    # The claim goes out once the KV is computed, however long the engine queues the send:
    # held from the start.
    async with holding(peers.hold_stub, addr, hold_timeout_s), held as slots:
        assert slots is not None  # fetched: this plane does not read them itself
        local = np.asarray(slots[offset:], dtype=np.int64)
        computed, marks = time.perf_counter(), _Marks()
        num_bytes = await _claim_and_write(
            peers, plane, addr, offer, local, remote, write_timeout_s, marks
        )
        times.settle(started, computed, marks)
    return addr.end - addr.begin, num_bytes


async def _write_early(
    peers: PeerChannels,
    plane: KVWritePlane,
    addr: KVAddrInfo,
    offer: NixlOffer,
    local: HeldSlots,
    remote: np.ndarray,
    held: AbstractAsyncContextManager[Slots | None],
    write_timeout_s: float,
    times: WriteTimes,
    started: float,
    hold: Hold,
) -> int:
    """Claim while the engine computes, and hand the core the write at once: it waits in
    the core and starts in the first loop turn after the KV is written, so neither the
    claim's round trip nor a message from here after the computation is on the send's path.
    The open claim holds the receiver's reservation. When the engine still computes as the
    claim's deadline nears, the core gives the write up (nixl_core.PARK_MARGIN_S before it,
    so the abandon reaches the receiver before its own deadline fences the pages): `hold`
    opens (the reservation then outlives the engine's queue), the claim is abandoned
    (nothing was written) and made again once the KV is there. A send that fails or is
    cancelled gives the write up before `held` lets the send's pages go, and abandons the
    claim when nothing was posted, so the receiver does not fence its pages."""
    stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    marks = _Marks()
    attempt = asyncio.ensure_future(_claim_and_write(
        peers, plane, addr, offer, local, remote, write_timeout_s, marks, stop=stop, hold=hold
    ))
    try:
        async with held:
            computed = time.perf_counter()
            try:
                try:
                    num_bytes = await asyncio.shield(attempt)
                except WriteNotStarted:
                    # given up as its deadline neared, the engine still computing: again
                    computed, marks = time.perf_counter(), _Marks()
                    num_bytes = await _claim_and_write(
                        peers, plane, addr, offer, local, remote, write_timeout_s, marks
                    )
            finally:
                await _give_up(attempt, stop)  # before the send's pages are let go
            times.settle(started, computed, marks)
            return num_bytes
    finally:
        await _give_up(attempt, stop)  # the send failed before its KV was computed


async def _give_up(attempt: asyncio.Future[int], stop: asyncio.Future[None]) -> None:
    """Stop an early write still running and wait for its end (it withdraws the write from
    the core and abandons or breaks off its claim)."""
    if attempt.done():
        if not attempt.cancelled():
            attempt.exception()  # retrieved: the caller saw or does not need it
        return
    if not stop.done():
        stop.set_result(None)
    await asyncio.gather(attempt, return_exceptions=True)


async def _claim_and_write(
    peers: PeerChannels,
    plane: KVWritePlane,
    addr: KVAddrInfo,
    offer: NixlOffer,
    local: np.ndarray | HeldSlots,
    remote: np.ndarray,
    write_timeout_s: float,
    marks: _Marks,
    *,
    stop: asyncio.Future[None] | None = None,
    hold: Hold | None = None,
) -> int:
    """Claim the reservation (WriteKV), write once the receiver is ready, return once it
    confirms; bytes written. `stop`, once set, gives the write up: WriteNotStarted (the
    claim abandoned, nothing to fence) when nothing of it was posted. A write the plane
    gives up so by itself (its KV not computed as the deadline nears) opens `hold` before
    the claim is abandoned: the send goes on."""
    deadline = time.monotonic() + write_timeout_s  # before the claim leaves: the receiver
    request = engine_pb2.WriteKVRequest(  # fences from its arrival, which is later
        request_id=addr.request_id,
        reservation_token=addr.reservation_token,
        layout=layout_to_pb(addr.layout),
        sender_agent=plane.name,
        offer_digest=addr.write_digest(),
        write_deadline_ms=max(1, int(write_timeout_s * 1e3)),
    )
    call = peers.write_stub(addr.address)(request)
    pending: list[asyncio.Future[Any]] = []
    try:
        pending.append(asyncio.ensure_future(call.read()))
        await _event(pending[-1], "ready", deadline, stop)
        marks.ready = time.perf_counter()
        pending.append(asyncio.ensure_future(call.read()))
        ended = pending[-1]
        try:
            num_bytes = await plane.write(
                offer, local, remote, addr.reservation_token.encode(),
                deadline=deadline, peer=ended, peer_landed=lambda: _is_done(ended), stop=stop,
            )
        except WriteNotStarted:
            raise
        except UnavailableError:
            if ended.done() and ended.exception() is not None:
                await _event(ended, "done", deadline)  # raises the peer's own error
            raise
        marks.written = time.perf_counter()
        await _event(ended, "done", deadline)
        marks.done = time.perf_counter()
        plane.landed(offer, addr.reservation_token.encode())
        return num_bytes
    except WriteNotStarted:
        if hold is not None and (stop is None or not stop.done()):
            hold.open()  # before the abandon: the reservation must outlive it
        await _abandon(peers, addr, plane.name, call, pending[-1])
        raise
    except UnavailableError:
        plane.drop_peer(offer.agent)  # reloaded from its next offer (it may have restarted)
        raise
    finally:
        for future in pending:
            future.cancel()
        if not marks.done:
            call.cancel()
        else:  # the receiver's status follows `done`: cancelling at once raced it (its gRPC
            # server logged a failed batch at ERROR); later, only a call that never ended
            asyncio.get_running_loop().call_later(_ABANDON_TIMEOUT_S, call.cancel)


async def _abandon(
    peers: PeerChannels, addr: KVAddrInfo, agent: str, call: aio.UnaryStreamCall,
    next_event: asyncio.Future[Any],
) -> None:
    """Tell the receiver that this claim wrote nothing (AbandonKVWrite), then wait for it to
    end the WriteKV call: ending the call first would look like a write broken off, whose
    pages it fences. Best effort: where either fails, the receiver fences until the
    claim's deadline."""
    request = engine_pb2.AbandonKVWriteRequest(
        request_id=addr.request_id, reservation_token=addr.reservation_token, sender_agent=agent
    )
    try:
        await peers.abandon_stub(addr.address)(request, timeout=_ABANDON_TIMEOUT_S)
        async with asyncio.timeout(_ABANDON_TIMEOUT_S):
            event = await asyncio.shield(next_event)
            while event is not aio.EOF:  # a `ready` still on its way
                event = await call.read()
    except (aio.AioRpcError, TimeoutError) as error:
        detail = error.details() if isinstance(error, aio.AioRpcError) else "no answer"
        logger.info("abandoning the KV write claim of %s at %s failed (%s); its pages stay "
                    "fenced until the claim's deadline", addr.request_id, addr.address, detail)


def _is_done(future: asyncio.Future[Any]) -> bool:
    """The receiver's next event came and is `done`: its transfer engine's notification
    arrived, which it sends only once the write has landed. The write has then ended for
    this side too, whether or not this side's agent has noticed yet."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return False
    event = future.result()
    return event is not aio.EOF and event.WhichOneof("event") == "done"


def _lap(mark: float) -> tuple[float, float]:
    now = time.perf_counter()
    return now, (now - mark) * 1e3


async def _event(
    future: asyncio.Future[Any], kind: str, deadline: float,
    stop: asyncio.Future[None] | None = None,
) -> None:
    """Wait (until `deadline`) for the WriteKV event `kind`; the peer's error mapped.
    WriteNotStarted once `stop` is set first."""
    if stop is not None:
        await asyncio.wait({future, stop}, timeout=max(0.0, deadline - time.monotonic()),
                           return_when=asyncio.FIRST_COMPLETED)
        if stop.done() and not future.done():
            raise WriteNotStarted(f"the KV write was given up before the receiver's {kind!r}")
    try:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the event and drops a
        # cancellation of this send that comes in the same turn of the loop.
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            event = await asyncio.shield(future)
    except TimeoutError:
        raise ReceiverUnavailableError(f"the receiver did not answer {kind!r} in time") from None
    except aio.AioRpcError as error:
        error_type = PEER_ERRORS.get(error.code(), ReceiverUnavailableError)
        raise error_type(f"KV write handshake failed: {error.details()}") from None
    if event is aio.EOF or event.WhichOneof("event") != kind:
        raise ReceiverUnavailableError(f"the receiver ended the KV write without {kind!r}")
