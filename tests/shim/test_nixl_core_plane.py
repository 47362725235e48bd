"""CoreNixlPlane, the shim's handle on the NIXL agent in the engine core's process, ends a
write on whichever comes first: the core's report that its side ended, or the receiver's
confirmation (its notification follows the data). Under load the core reports only between
steps, so the confirmation usually wins; that is a landed write, not a failure, and the
transfer is left for the core to release when it ends. The core here is a recorder of the
ops the plane sends it, which never reports back, as a core busy in a long step."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from engine_shim.backends.embedded.kv_plane.addr import NixlOffer
from engine_shim.backends.embedded.kv_plane.nixl import HeldSlots
from engine_shim.backends.embedded.kv_plane.nixl_core import CoreNixlPlane
from engine_shim.engine.api import UnavailableError

OFFER = NixlOffer(agent="receiver", metadata="", mem_type="DRAM", device_id=0, base=4096,
                  num_planes=4, plane_bytes=1 << 20, slot_bytes=256)


class _BusyCore:
    """Takes the plane's side ops and reports nothing back."""

    def __init__(self) -> None:
        self.ops: list[str] = []
        self.on_side_events: Any = None

    def submit_side(self, op: str, *args: Any) -> None:
        self.ops.append(op)


async def _write(plane: CoreNixlPlane, peer: asyncio.Future[str]) -> int:
    return await plane.write(
        OFFER, HeldSlots("req", 0), np.arange(8, dtype=np.int64), b"tag",
        deadline=time.monotonic() + 30, peer=peer,
        peer_landed=lambda: peer.done() and peer.result() == "done",
    )


async def test_the_receivers_confirmation_ends_a_write_the_core_has_not_reported() -> None:
    core = _BusyCore()
    plane = CoreNixlPlane(core, OFFER)  # type: ignore[arg-type]
    peer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    write = asyncio.ensure_future(_write(plane, peer))
    await asyncio.sleep(0.05)
    assert not write.done()  # neither side has said anything yet
    peer.set_result("done")
    assert await asyncio.wait_for(write, 5) == OFFER.num_planes * 8 * OFFER.slot_bytes
    assert core.ops == ["nixl_write"]  # not cancelled: the core releases it once it ends


async def test_a_receiver_that_ends_otherwise_fails_the_write_and_cancels_it() -> None:
    core = _BusyCore()
    plane = CoreNixlPlane(core, OFFER)  # type: ignore[arg-type]
    peer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    write = asyncio.ensure_future(_write(plane, peer))
    await asyncio.sleep(0.05)
    peer.set_result("eof")
    with pytest.raises(UnavailableError):
        await asyncio.wait_for(write, 5)
    assert core.ops == ["nixl_write", "nixl_cancel"]
