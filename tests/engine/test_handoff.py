"""The engine thread's hand-off into the event loop: every batch, in order, with one wake-up
of the loop for however many batches arrived while it was busy."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from engine_shim.engine.api import StatusFields
from engine_shim.engine.async_engine import _Handoff

pytestmark = pytest.mark.unit


def _fields(index: int) -> StatusFields:
    return (index, 0, 0, 0, (0, 0, 0, 0, 0), None)


def test_batches_arrive_in_order_with_one_wakeup_for_those_a_busy_loop_missed() -> None:
    async def main() -> tuple[list[object], int]:
        loop = asyncio.get_running_loop()
        received: list[object] = []

        def deliver(batch: list[tuple[Any, ...]], status: Any) -> None:
            received.append(status)

        handoff = _Handoff(loop, deliver)
        wakeups = 0
        drain = handoff._drain

        def counted_drain() -> None:
            nonlocal wakeups
            wakeups += 1
            drain()

        handoff._drain = counted_drain  # type: ignore[method-assign]

        def engine_thread() -> None:
            for index in range(200):
                handoff.emit([], _fields(index))

        thread = threading.Thread(target=engine_thread)
        thread.start()
        time.sleep(0.2)  # the loop is busy (blocked) while the thread emits everything
        thread.join()
        while len(received) < 200:
            await asyncio.sleep(0.01)
        handoff.emit([], _fields(200))  # the loop idle again: delivered at once
        await asyncio.sleep(0.01)
        return received, wakeups

    received, wakeups = asyncio.run(main())
    assert received == [_fields(index) for index in range(201)]
    assert wakeups == 2  # one for the 200 sent while the loop was blocked, one for the last
