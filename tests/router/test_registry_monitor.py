"""The registry's monitors end when the router stops, whenever the stop comes: a monitor
whose wake-up (a failed call's early recheck) lands in the same turn of the event loop as
its cancellation must not lose the cancellation, or `stop()` waits on it forever."""

from __future__ import annotations

import asyncio

import pytest

from microserving.transport import TransportSettings
from router.registry import EngineRegistry

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("turns", range(6))
async def test_a_sleeping_monitor_woken_and_cancelled_in_one_turn_ends_cancelled(turns: int) -> None:
    registry = EngineRegistry(TransportSettings(), health_interval_s=60.0)
    wake = asyncio.Event()
    sleeper = asyncio.get_running_loop().create_task(registry._sleep(wake))
    await asyncio.sleep(0)  # asleep on the event
    wake.set()
    for _ in range(turns):  # the wake-up travels through the loop for `turns` turns
        await asyncio.sleep(0)
    if not sleeper.cancel():
        assert sleeper.result() is None  # woke and ended before the cancel: nothing to lose
        return
    with pytest.raises(asyncio.CancelledError):  # Python 3.11's wait_for returned instead
        await asyncio.wait_for(sleeper, 5.0)
