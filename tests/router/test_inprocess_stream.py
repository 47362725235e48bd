"""router/inprocess.py's stream on its own: what reaches the caller when a request task ends
well, fails, or is cancelled by `close`. The request host here is a stand-in that writes
events into the stream's Outbox; the real router behind it is tested end to end in
tests/e2e/test_serve_colocated.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio

from microserving.v1 import router_pb2
from router.inprocess import InProcessStream
from router.outbox import Outbox


class Host:
    """Runs each request by a script: tokens, then done, or an exception, or waiting."""

    def __init__(self, script: str) -> None:
        self.script = script
        self.cancelled: list[str] = []
        self.started = asyncio.Event()

    async def run(self, new: router_pb2.NewRequest, outbox: Outbox) -> None:
        self.started.set()
        outbox.put_delta(new.request_id, 0, [5], "a")
        if self.script == "fail":
            raise RuntimeError("a bug in the router")
        if self.script == "wait":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.append(new.request_id)
                raise
        outbox.put_delta(new.request_id, 0, [6], "b")
        outbox.put(new.request_id, done=router_pb2.RequestDone())


def _new(request_id: str) -> router_pb2.NewRequest:
    return router_pb2.NewRequest(request_id=request_id)


async def _collect(stream: InProcessStream) -> list[router_pb2.GenerateResponse]:
    return [event async for batch in stream.batches() for event in batch]


async def test_events_come_merged_in_order_until_done() -> None:
    stream = InProcessStream(Host("ok"))  # type: ignore[arg-type]
    await stream.start([_new("r1"), _new("r2")])
    assert not stream.is_finished
    events = await asyncio.wait_for(_collect(stream), 5)
    by_id: dict[str, list[str]] = {"r1": [], "r2": []}
    for event in events:
        kind = event.WhichOneof("event")
        by_id[event.request_id].append(event.delta.text if kind == "delta" else kind)
    # Both deltas of a request were queued before the caller's turn: one merged delta.
    assert by_id == {"r1": ["ab", "done"], "r2": ["ab", "done"]}
    assert stream.is_finished


async def test_a_request_that_fails_ends_with_an_internal_error_not_a_hang() -> None:
    stream = InProcessStream(Host("fail"))  # type: ignore[arg-type]
    await stream.start([_new("r1")])
    events = await asyncio.wait_for(_collect(stream), 5)
    assert [e.WhichOneof("event") for e in events] == ["delta", "error"]
    assert events[-1].error.code == grpc.StatusCode.INTERNAL.value[0]
    assert stream.is_finished


async def test_close_cancels_the_unfinished_requests_and_ends_the_reader() -> None:
    host = Host("wait")
    stream = InProcessStream(host)  # type: ignore[arg-type]
    await stream.start([_new("r1")])
    reader = asyncio.create_task(_collect(stream))
    await asyncio.wait_for(host.started.wait(), 5)
    await asyncio.sleep(0)
    stream.close()
    events = await asyncio.wait_for(reader, 5)
    await asyncio.sleep(0)
    assert host.cancelled == ["r1"]
    assert all(e.WhichOneof("event") == "delta" for e in events)


async def test_repeated_request_ids_are_refused_before_anything_runs() -> None:
    host = Host("ok")
    stream = InProcessStream(host)  # type: ignore[arg-type]
    with pytest.raises(aio.AioRpcError) as raised:
        await stream.start([_new("same"), _new("same")])
    assert raised.value.code() == grpc.StatusCode.INTERNAL
    assert not host.started.is_set()
