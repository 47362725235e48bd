"""The sending side of a NIXL write: holding the receiver's reservation from the start
(hold.py), and with the send's pages held once computed, claim the receiver's
reservation over KVTransfer.WriteKV (quoting the offer it writes by and a deadline), write the
pages straight into the reserved slots once the receiver says ready, and return once it says
the notification arrived. Writes go only to an agent that this authenticated peer confirmed
for this reservation, only into the slots it reserved."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
from grpc import aio

from engine_shim.backends.embedded.kv_plane.addr import KVAddrInfo, NixlOffer
from engine_shim.backends.embedded.kv_plane.hold import holding
from engine_shim.backends.embedded.kv_plane.nixl import HeldSlots, KVWritePlane
from engine_shim.backends.embedded.kv_plane.nixl_descs import segment_slots
from engine_shim.backends.embedded.kv_plane.sender import (
    PEER_ERRORS,
    PeerChannels,
    ReceiverUnavailableError,
)
from engine_shim.convert import layout_to_pb
from engine_shim.engine.api import UnavailableError
from microserving.v1 import engine_pb2


@dataclass
class WriteTimes:
    """Where a write's time went (ms): the engine holding the send's pages (its prefill, if
    any), the claim's round trip, the transfer, the receiver's confirmation."""

    hold_ms: float = 0.0
    accept_ms: float = 0.0  # of hold_ms: until the engine took the send (its call's round trip)
    claim_ms: float = 0.0
    transfer_ms: float = 0.0
    confirm_ms: float = 0.0

    def __str__(self) -> str:
        return (
            f"hold {self.hold_ms:.1f} (accepted at {self.accept_ms:.1f}), claim {self.claim_ms:.1f}, "
            f"transfer {self.transfer_ms:.1f}, confirm {self.confirm_ms:.1f} ms"
        )


async def write_kv(
    peers: PeerChannels,
    plane: KVWritePlane,
    addr: KVAddrInfo,
    held: AbstractAsyncContextManager[Sequence[int] | None],
    *,
    send_id: str,
    window_begin: int,
    write_timeout_s: float,
    hold_timeout_s: float = 300.0,
    times: WriteTimes | None = None,
) -> tuple[int, int]:
    """Write the held send's KV (slots of [window_begin, end)) into `addr`'s reservation;
    (tokens, bytes) written. `held` yields the send's slots, or None where the plane reads
    them itself (KVWritePlane.reads_held_slots: the engine's send `send_id`). The receiver holds the reservation from the start (at most
    `hold_timeout_s`), however long the engine queues the send. Raises UnavailableError when
    the peer or its agent fails, or the write does not land within `write_timeout_s` of the
    claim."""
    offer = addr.nixl
    if offer is None:
        raise UnavailableError("the receiver made no NIXL offer")
    times = WriteTimes() if times is None else times
    await plane.load_peer(offer)
    started = time.perf_counter()
    async with holding(peers.hold_stub, addr, hold_timeout_s), held as slots:
        times.hold_ms = (time.perf_counter() - started) * 1e3
        offset = addr.begin - window_begin
        local = (HeldSlots(send_id, offset) if slots is None
                 else np.asarray(slots[offset:], dtype=np.int64))
        remote = segment_slots(addr.kv_segments)
        num_bytes = await _claim_and_write(
            peers, plane, addr, offer, local, remote, write_timeout_s, times
        )
    return addr.end - addr.begin, num_bytes


async def _claim_and_write(
    peers: PeerChannels,
    plane: KVWritePlane,
    addr: KVAddrInfo,
    offer: NixlOffer,
    local: np.ndarray | HeldSlots,
    remote: np.ndarray,
    write_timeout_s: float,
    times: WriteTimes,
) -> int:
    mark = time.perf_counter()
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
        await _event(pending[-1], "ready", deadline)
        mark, times.claim_ms = _lap(mark)
        pending.append(asyncio.ensure_future(call.read()))
        ended = pending[-1]
        try:
            num_bytes = await plane.write(
                offer, local, remote, addr.reservation_token.encode(),
                deadline=deadline, peer=ended, peer_landed=lambda: _is_done(ended),
            )
        except UnavailableError:
            if ended.done() and ended.exception() is not None:
                await _event(ended, "done", deadline)  # raises the peer's own error
            raise
        mark, times.transfer_ms = _lap(mark)
        await _event(ended, "done", deadline)
        _, times.confirm_ms = _lap(mark)
        return num_bytes
    except UnavailableError:
        plane.drop_peer(offer.agent)  # reloaded from its next offer (it may have restarted)
        raise
    finally:
        for future in pending:
            future.cancel()
        call.cancel()  # a no-op once the call has ended


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


async def _event(future: asyncio.Future[Any], kind: str, deadline: float) -> None:
    """Wait (until `deadline`) for the WriteKV event `kind`; the peer's error mapped."""
    try:
        event = await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise ReceiverUnavailableError(f"the receiver did not answer {kind!r} in time") from None
    except aio.AioRpcError as error:
        error_type = PEER_ERRORS.get(error.code(), ReceiverUnavailableError)
        raise error_type(f"KV write handshake failed: {error.details()}") from None
    if event is aio.EOF or event.WhichOneof("event") != kind:
        raise ReceiverUnavailableError(f"the receiver ended the KV write without {kind!r}")
