"""The engine core process's pipe: the core's loop writes one frame per batch without
blocking, a thread of its own takes over what the pipe cannot take at once, and the shim's
reader gets every batch whole and in order, however the bytes arrive."""

from __future__ import annotations

import multiprocessing
import queue
import select
import threading
import time

import pytest

from engine_shim.engine.core_loop import STOP
from engine_shim.engine.core_process import _FINE_WAIT_S, _FrameReader, _PipeInbox, _Writer

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
