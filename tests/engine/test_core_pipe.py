"""The engine core process's pipe: the core's loop writes one frame per batch without
blocking, a thread of its own takes over what the pipe cannot take at once, and the shim's
reader gets every batch whole and in order, however the bytes arrive."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import select
import threading
import time

import pytest

from engine_shim.engine.core_loop import EVENTS, RESULT, STOP, Call
from engine_shim.engine.core_process import (
    _FINE_WAIT_S,
    ProcessDriver,
    _CallWriter,
    _FrameReader,
    _PipeInbox,
    _Writer,
)

pytestmark = pytest.mark.unit


def _batch(index: int) -> list[tuple[object, ...]]:
    # Every 7th batch is larger than the socket's buffer, so the loop's write cannot finish.
    size = 3 << 20 if index % 7 == 3 else 40
    return [(1, [(f"req-{index}", ((0, (index,), "x" * size, (), None),), None)])]


def test_frames_arrive_whole_and_in_order_through_a_full_pipe() -> None:
    shim_end, core_end = multiprocessing.Pipe(duplex=True)
    writer = _Writer(core_end)
    reader = _FrameReader(shim_end)
    try:
        num_batches = 60
        for index in range(num_batches):  # nobody reads yet: the pipe fills
            writer.emit(_batch(index), (index, 0, 0, 0, (0, 0, 0, 0, 0), None))
        assert writer._num_queued > 0  # the thread holds what the pipe could not take
        received: list[tuple[object, object]] = []
        deadline = time.monotonic() + 60
        while len(received) < num_batches and time.monotonic() < deadline:
            select.select([shim_end.fileno()], [], [], 1.0)
            batches, is_closed = reader.read()
            assert not is_closed
            received += batches
        assert [status for _, status in received] == [
            (index, 0, 0, 0, (0, 0, 0, 0, 0), None) for index in range(num_batches)
        ]
        assert [batch for batch, _ in received] == [_batch(index) for index in range(num_batches)]
        writer.emit(_batch(1), (99, 0, 0, 0, (0, 0, 0, 0, 0), None))  # inline again, once drained
    finally:
        writer.close()
        core_end.close()
    last: list[tuple[object, object]] = []
    for _ in range(3):  # a read that got bytes leaves the end to the next one
        batches, is_closed = reader.read()
        last += batches
        if is_closed:
            break
    assert [status[0] for _, status in last] == [99]  # what came before the close, then the end
    assert is_closed
    reader.close()
    shim_end.close()


@pytest.mark.parametrize("timeout", [None, _FINE_WAIT_S / 10, _FINE_WAIT_S * 4])
def test_the_inbox_waits_then_takes_what_comes_in_order(timeout: float | None) -> None:
    """Every wait the loop makes (none, a short one through select, a long one through
    poll): empty while nothing came, then each call in the order sent, woken by its arrival
    (a sender that writes mid-wait), and STOP once the shim's end is closed."""
    shim_end, core_end = multiprocessing.Pipe(duplex=True)
    inbox = _PipeInbox(core_end)
    try:
        with pytest.raises(queue.Empty):
            inbox.get(timeout)
        for item in ("first", "second"):
            shim_end.send(item)
        assert [inbox.get(timeout), inbox.get(timeout)] == ["first", "second"]
        if timeout is not None:
            late = threading.Timer(timeout / 4, shim_end.send, args=("late",))
            late.start()
            got = None
            deadline = time.monotonic() + 60
            while got is None and time.monotonic() < deadline:  # a loaded machine may wait longer
                try:
                    got = inbox.get(timeout)
                except queue.Empty:
                    continue
            late.join()
            assert got == "late"
        shim_end.close()
        assert inbox.get(timeout if timeout is not None else 1.0) == STOP
    finally:
        core_end.close()


# ---- calls from the shim's event loop to the core ----

_CALL_BYTES = 64 << 10
_NUM_CALLS = 200  # 12.5 MiB in all: far more than a socket pair's buffer


def test_calls_cross_whole_and_in_order_though_the_loop_made_the_pipe_non_blocking() -> None:
    """uvloop's add_reader sets the pipe non-blocking (libuv's poll handles do), where
    Connection.send into a full pipe raises BlockingIOError, after writing part of a message
    or none of it. The shim's writer queues what the pipe cannot take and writes it as the
    pipe drains: every call arrives whole, in order, read by the child's Connection.recv."""
    uvloop = pytest.importorskip("uvloop")  # the shim's default loop where it is installed
    shim_end, core_end = multiprocessing.Pipe(duplex=True)
    calls = [Call(index, "abort", (f"{index}:" + "x" * _CALL_BYTES,)) for index in range(_NUM_CALLS)]
    received: list[object] = []

    def read_all() -> None:  # the core's side: slower than the burst, so the pipe fills
        for _ in range(_NUM_CALLS):
            received.append(core_end.recv())

    async def main() -> int:
        loop = asyncio.get_running_loop()
        loop.add_reader(shim_end.fileno(), lambda: None)
        assert os.get_blocking(shim_end.fileno()) is False  # the premise: uvloop did it
        writer = _CallWriter(shim_end, loop)
        most_queued = 0
        for call in calls:  # one burst, as a wave of requests sends it
            writer.send(call)
            most_queued = max(most_queued, writer.num_pending_bytes)
        reader = threading.Thread(target=read_all)
        reader.start()
        deadline = time.monotonic() + 120
        while writer.num_pending_bytes and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(reader.join, 120)
        loop.remove_reader(shim_end.fileno())
        writer.close()
        return most_queued

    try:
        most_queued = uvloop.run(main())
    finally:
        shim_end.close()
        core_end.close()
    assert most_queued > 0  # the pipe was full: calls waited in the writer
    assert received == calls


def test_a_burst_of_calls_reaches_a_core_process_on_uvloop() -> None:
    """The engine core in its own process, driven from uvloop: a burst of calls nobody waits
    for (as a wave of NIXL writes submits them) fills the pipe, and every one of them still
    runs, in order, before the call that follows them. Before the shim had its own writer,
    the burst's send into the full pipe failed with "engine process unreachable" (and a
    call nobody waited for was lost without a word)."""
    uvloop = pytest.importorskip("uvloop")
    from functools import partial

    from engine_shim.backends.synthetic.core import SyntheticCore
    from engine_shim.backends.synthetic.profile import StepProfile
    from engine_shim.engine.config import EngineConfig

    core_factory = partial(SyntheticCore, profile=StepProfile.parse("1:1"))
    batches: list[list[tuple[object, ...]]] = []

    async def main() -> list[object]:
        driver = ProcessDriver(EngineConfig(model="tiny"), core_factory)  # type: ignore[arg-type]
        lost: list[str] = []
        await driver.start(lambda batch, status: batches.append(batch), lost.append)
        try:
            for index in range(_NUM_CALLS):  # one burst: the pipe fills
                driver.submit(Call(None, "abort", (f"absent-{index}-" + "x" * _CALL_BYTES,)))
            for index in range(3):  # then calls whose answers come back in order
                driver.submit(Call(index, "abort", (f"last-{index}",)))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and sum(
                entry[0] == RESULT for batch in batches for entry in batch
            ) < 3:
                await asyncio.sleep(0.02)
        finally:
            await driver.stop()
        assert not lost
        return [entry for batch in batches for entry in batch]

    entries = uvloop.run(main())
    # each call nobody waited for reports the status it left (an empty EVENTS entry), in order
    # before the answers of the calls that came after it
    kinds = [entry[0] for entry in entries if entry[0] in (EVENTS, RESULT)]
    assert kinds.count(EVENTS) >= _NUM_CALLS
    results = [entry for entry in entries if entry[0] == RESULT]
    assert [(call_id, value, error) for _, call_id, value, error in results] == [
        (0, False, None), (1, False, None), (2, False, None)
    ]
    assert kinds.index(RESULT) >= _NUM_CALLS  # the answers came after the whole burst ran
