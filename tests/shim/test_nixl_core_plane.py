"""CoreNixlPlane, the shim's handle on the NIXL agent in the engine core's process, ends a
write on whichever comes first: the core's report that its side ended, or the receiver's
confirmation (its notification follows the data). Under load the core reports only between
steps, so the confirmation usually wins; that is a landed write, not a failure, and the
transfer is left for the core to release when it ends. A write given up while it still
waits in the core (parked: its send still computing) was never posted, so the sender
abandons its claim and the receiver (a real decode shim here) keeps the reservation open and
unfenced. The core here is a recorder of the ops the plane sends it, which never reports
back, as a core busy in a long step; it answers a cancel as a core whose write was parked
(or posted, or not at all), as the test says."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from shim_helpers import PROMPT, engine_stub, free_pages, greedy, wait_for_free_pages

from engine_shim.backends.embedded.kv_plane.addr import KVAddrInfo, NixlOffer
from engine_shim.backends.embedded.kv_plane.nixl import HeldSlots, WriteNotStarted, load_nixl
from engine_shim.backends.embedded.kv_plane.nixl_core import CoreNixlPlane
from engine_shim.backends.embedded.kv_plane.nixl_descs import segment_slots
from engine_shim.backends.embedded.kv_plane.nixl_sender import _claim_and_write, _Marks
from engine_shim.backends.embedded.kv_plane.sender import PeerChannels
from engine_shim.engine.api import UnavailableError
from microserving.transport import TransportSettings
from microserving.v1 import engine_pb2

OFFER = NixlOffer(agent="receiver", metadata="", mem_type="DRAM", device_id=0, base=4096,
                  num_planes=4, plane_bytes=1 << 20, slot_bytes=256)


class _BusyCore:
    """Takes the plane's side ops and reports nothing back."""

    def __init__(self, was_parked: bool | None = True) -> None:
        self.ops: list[str] = []
        self.on_side_events: Any = None
        self._was_parked = was_parked  # a cancel's answer; None: never answers

    def submit_side(self, op: str, *args: Any) -> None:
        self.ops.append(op)

    async def call_side(self, op: str, *args: Any) -> object:
        self.ops.append(op)
        if self._was_parked is None:
            await asyncio.Event().wait()
        return self._was_parked  # a cancel: whether the write was still parked


async def _started_write(
    core: _BusyCore | None = None, deadline_s: float = 30.0
) -> tuple[_BusyCore, asyncio.Future[str], asyncio.Future[int]]:
    """A write through a plane over a busy core, under way: (the core, the receiver's next
    event to set, the write)."""
    core = _BusyCore() if core is None else core
    plane = CoreNixlPlane(core, OFFER)  # type: ignore[arg-type]
    peer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    write = asyncio.ensure_future(plane.write(
        OFFER, HeldSlots("req", 0), np.arange(8, dtype=np.int64), b"tag",
        deadline=time.monotonic() + deadline_s, peer=peer,
        peer_landed=lambda: peer.done() and peer.result() == "done",
    ))
    await asyncio.sleep(0.05)
    return core, peer, write


async def test_the_receivers_confirmation_ends_a_write_the_core_has_not_reported() -> None:
    core, peer, write = await _started_write()
    assert not write.done()  # neither side has said anything yet
    peer.set_result("done")
    assert await asyncio.wait_for(write, 5) == OFFER.num_planes * 8 * OFFER.slot_bytes
    assert core.ops == ["nixl_write"]  # not cancelled: the core releases it once it ends


async def test_a_receiver_that_ends_otherwise_fails_the_write_and_cancels_it() -> None:
    core, peer, write = await _started_write()
    peer.set_result("eof")
    with pytest.raises(UnavailableError):
        await asyncio.wait_for(write, 5)
    assert core.ops == ["nixl_write", "nixl_cancel"]


@pytest.mark.parametrize("was_parked", [True, False, None], ids=["parked", "posted", "no-answer"])
async def test_a_write_past_its_deadline_is_withdrawn_and_says_whether_it_started(
    was_parked: bool | None,
) -> None:
    """At its deadline a write neither side has ended is withdrawn from the core: one still
    parked there (its send's KV not computed; the core drops such a write too, but only
    between steps) ends WriteNotStarted, so its sender may abandon the claim and claim again;
    one posted, or a core that does not answer the withdrawal, fails the write."""
    core, _, write = await _started_write(_BusyCore(was_parked), deadline_s=0.2)
    expected = WriteNotStarted if was_parked else UnavailableError
    with pytest.raises(expected) as ended:
        await asyncio.wait_for(write, 10)
    assert was_parked or not isinstance(ended.value, WriteNotStarted)
    assert core.ops == ["nixl_write", "nixl_cancel"]


async def test_a_write_given_up_over_a_core_that_does_not_answer_fails_within_its_bound() -> None:
    """A send that ends (`stop`) withdraws its write; a core that never answers the withdrawal
    (stuck in a step, or gone) fails the write after a bounded wait instead of holding the
    send open."""
    core = _BusyCore(was_parked=None)
    plane = CoreNixlPlane(core, OFFER)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    peer: asyncio.Future[str] = loop.create_future()
    stop: asyncio.Future[None] = loop.create_future()
    write = asyncio.ensure_future(plane.write(
        OFFER, HeldSlots("req", 0), np.arange(8, dtype=np.int64), b"tag",
        deadline=time.monotonic() + 60, peer=peer, peer_landed=lambda: False, stop=stop,
    ))
    await asyncio.sleep(0.05)
    stop.set_result(None)
    with pytest.raises(UnavailableError) as ended:
        await asyncio.wait_for(write, 10)
    assert not isinstance(ended.value, WriteNotStarted)
    assert core.ops == ["nixl_write", "nixl_cancel"]


@pytest.mark.skipif(load_nixl()[0] is None, reason="NIXL cannot load here")
async def test_a_write_given_up_while_parked_abandons_its_claim_unfenced(decode_shim) -> None:
    channel, stub = engine_stub(decode_shim.address)
    peers = PeerChannels(TransportSettings())
    async with channel:
        baseline = await free_pages(stub)
        tokens = [t + 139 for t in PROMPT]
        prep = await stub.PrepRecv(engine_pb2.PrepRecvRequest(
            request_id="given-up", token_ids=tokens, end=-1, sampling=greedy()))
        addr = KVAddrInfo.decode(prep.kv_addr_info)
        assert addr.nixl is not None
        core = _BusyCore()
        plane = CoreNixlPlane(core, OFFER)  # type: ignore[arg-type]
        stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        attempt = asyncio.ensure_future(_claim_and_write(
            peers, plane, addr, addr.nixl, HeldSlots("given-up", 0),
            segment_slots(addr.kv_segments), 60.0, _Marks(), stop=stop,
        ))
        for _ in range(1000):  # the claim's `ready` came: the write went to the core
            if core.ops or attempt.done():
                break
            await asyncio.sleep(0.01)
        assert core.ops == ["nixl_write"]
        stop.set_result(None)
        with pytest.raises(WriteNotStarted):
            await attempt
        assert core.ops == ["nixl_write", "nixl_cancel"]
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
        assert status.num_reserved_requests == 1  # still open for another claim
        await stub.Abort(engine_pb2.AbortRequest(request_id="given-up"))
        # freed at once: a claim broken off without a word would fence them for a minute
        assert await wait_for_free_pages(stub, baseline, within_s=10) == baseline
    await peers.close()

