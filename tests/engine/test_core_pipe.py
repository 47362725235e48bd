"""The engine core process's pipe: the core's loop writes one frame per batch without
blocking, a thread of its own takes over what the pipe cannot take at once, and the shim's
reader gets every batch whole and in order, however the bytes arrive."""

from __future__ import annotations

import multiprocessing
import select
import time

import pytest

from engine_shim.engine.core_process import _FrameReader, _Writer

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
