"""microserving.multiplex.MultiplexedCall, the client end every multiplexed stream shares,
over a real gRPC call to an in-process server: writes from many callers go out in the
order they were queued, one at a time, each caller waiting for its own; a caller cancelled
while its message queued does not take the message (nor the call) with it; when the call
breaks, every write queued or in flight and every later one raises the call's error, and
every open request hears of it; with a batch function, what queued behind a write in flight
goes out as one message, in order, within MAX_BATCH_BYTES."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio

from microserving.multiplex import MAX_BATCH_BYTES, MultiplexedCall
from microserving.transport import TransportSettings
from microserving.v1 import engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from router.endpoint import Endpoint
from router.engines import EngineStream, batched_actions

pytestmark = pytest.mark.unit


class _Recording(router_pb2_grpc.RouterServicer):
    """Records each request id it reads. On the id "stall" it stops reading until `release` is
    set, then ends the call with UNAVAILABLE (a peer that stopped reading and then died)."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.arrived = asyncio.Condition()
        self.release = asyncio.Event()

    async def GenerateBatched(self, requests, context) -> AsyncIterator[router_pb2.GenerateBatchedResponse]:  # type: ignore[no-untyped-def]  # noqa: N802
        async for message in requests:
            request_id = message.generate.request_id
            async with self.arrived:
                self.seen.append(request_id)
                self.arrived.notify_all()
            if request_id == "stall":
                await self.release.wait()
                await context.abort(grpc.StatusCode.UNAVAILABLE, "broken on purpose")
        if False:  # pragma: no cover - an async generator that answers nothing
            yield router_pb2.GenerateBatchedResponse()


class _Sink:
    def __init__(self) -> None:
        self.failed: list[grpc.StatusCode] = []

    def deliver(self, entry: router_pb2.GenerateResponse) -> bool:
        return True

    def fail(self, error: aio.AioRpcError) -> None:
        self.failed.append(error.code())


@pytest.fixture
async def served() -> AsyncIterator[tuple[_Recording, router_pb2_grpc.RouterStub]]:
    servicer = _Recording()
    server = aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, router_pb2_grpc.RouterStub(channel)
    await channel.close()
    await server.stop(None)


def _start(request_id: str) -> router_pb2.GenerateBatchedRequest:
    return router_pb2.GenerateBatchedRequest(generate=router_pb2.NewRequest(request_id=request_id))


def _call(stub: router_pb2_grpc.RouterStub) -> MultiplexedCall[router_pb2.GenerateBatchedResponse, router_pb2.GenerateResponse]:
    return MultiplexedCall(stub.GenerateBatched(), lambda batch: batch.responses, lambda entry: entry.request_id)


async def _until_seen(servicer: _Recording, count: int) -> None:
    async with servicer.arrived:
        await asyncio.wait_for(servicer.arrived.wait_for(lambda: len(servicer.seen) >= count), 60)


async def test_writes_go_out_in_queue_order_and_a_cancelled_caller_keeps_its_message(served) -> None:
    servicer, stub = served
    call = _call(stub)
    ids = [f"r{i}" for i in range(50)]
    writers = [asyncio.ensure_future(call.write(_start(request_id))) for request_id in ids]
    await asyncio.sleep(0)  # every caller has queued its message and waits for its write
    writers[7].cancel()  # its caller goes away while the message waits its turn
    writers[30].cancel()
    results = await asyncio.gather(*writers, return_exceptions=True)
    assert [type(r) for i, r in enumerate(results) if i in (7, 30)] == [asyncio.CancelledError] * 2
    assert all(r is None for i, r in enumerate(results) if i not in (7, 30))
    await _until_seen(servicer, len(ids))
    assert servicer.seen == ids
    # The call carries on after the cancelled callers.
    await call.write(_start("after"))
    await _until_seen(servicer, len(ids) + 1)
    assert call.is_usable()
    await call.close()


async def test_a_broken_call_fails_queued_and_later_writes_and_its_open_requests(served) -> None:
    servicer, stub = served
    call = _call(stub)
    sink = _Sink()
    await call.start("open", _start("open"), sink)
    await call.write(_start("stall"))
    await _until_seen(servicer, 2)
    # Big messages the stalled peer does not read: the first ones fill the connection's
    # windows, so one write stays in flight and the rest queue behind it.
    big = [_start(f"big{i}") for i in range(24)]
    for message in big:
        message.generate.token_ids.ids.extend(range(500_000))  # ~2.4 MB each
    writes = [asyncio.ensure_future(call.write(message)) for message in big]
    done, _ = await asyncio.wait(writes, timeout=0.5)
    assert len(done) < len(writes)  # some are stuck: the peer reads nothing
    servicer.release.set()  # the peer ends the call
    results = await asyncio.wait_for(asyncio.gather(*writes, return_exceptions=True), 60)
    failed = [r for r in results if r is not None]
    assert failed and all(isinstance(r, aio.AioRpcError) and r.code() is grpc.StatusCode.UNAVAILABLE
                          for r in failed), results
    assert call.broken is not None
    assert sink.failed == [grpc.StatusCode.UNAVAILABLE]
    with pytest.raises(aio.AioRpcError) as later:
        await call.write(_start("later"))
    assert later.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "later" not in servicer.seen
    await call.close()


class _EngineRecording(engine_pb2_grpc.EngineServicer):
    """Records each Engine.Generate message it reads as the start ids it carries (a batch's
    in order)."""

    def __init__(self) -> None:
        self.messages: list[list[str]] = []
        self.arrived = asyncio.Condition()

    async def Generate(self, requests, context) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:  # type: ignore[no-untyped-def]  # noqa: N802
        async for message in requests:
            actions = message.batch.actions if message.WhichOneof("action") == "batch" else [message]
            async with self.arrived:
                self.messages.append([action.start.request_id for action in actions])
                self.arrived.notify_all()
        if False:  # pragma: no cover - an async generator that answers nothing
            yield engine_pb2.EngineGenerateResponse()

    async def until_read(self, count: int) -> None:
        """Until `count` actions have come, in however many messages."""
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: sum(map(len, self.messages)) == count), 60)


@pytest.fixture
async def engine_served() -> AsyncIterator[tuple[_EngineRecording, str]]:
    servicer = _EngineRecording()
    server = aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(None)


def _engine_start(request_id: str, num_tokens: int = 8) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(start=engine_pb2.StartGenerateRequest(
        request_id=request_id, token_ids=list(range(num_tokens))))


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "each-alone"])
async def test_writes_queued_behind_one_in_flight_go_out_in_one_message_within_the_bound(
    engine_served, batch: bool,
) -> None:
    servicer, address = engine_served
    async with aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        call: MultiplexedCall[engine_pb2.EngineGenerateResponse, engine_pb2.GenerateOutput] = MultiplexedCall(
            stub.Generate(), lambda message: message.outputs, lambda entry: entry.request_id,
            batch=batched_actions if batch else None)
        # Queued in one turn of the loop, before the writer runs: one write, the rest
        # behind it; a message above the bound goes alone.
        big = _engine_start("big", MAX_BATCH_BYTES // 2)  # varints of 1-3 bytes: above it
        assert big.ByteSize() > MAX_BATCH_BYTES
        messages = [_engine_start(f"r{i}") for i in range(6)] + [big, _engine_start("after")]
        await asyncio.wait_for(asyncio.gather(*(call.write(m) for m in messages)), 60)
        expected = [m.start.request_id for m in messages]
        await servicer.until_read(len(messages))
        assert [rid for message in servicer.messages for rid in message] == expected
        if batch:
            assert servicer.messages == [expected[:6], ["big"], ["after"]]
        else:
            assert servicer.messages == [[rid] for rid in expected]
        call.call.cancel()


class _NoSink:
    def deliver(self, entry: engine_pb2.GenerateOutput) -> bool:
        return False

    def fail(self, error: aio.AioRpcError) -> None:
        pass


@pytest.mark.parametrize(("takes", "batches", "merged"), [(True, True, True), (False, True, False), (True, False, False)],
                         ids=["engine-and-router-agree", "engine-does-not-take-them", "router-setting-off"])
async def test_a_routers_engine_stream_batches_where_the_engine_takes_them_and_the_setting_allows(
    engine_served, takes: bool, batches: bool, merged: bool,
) -> None:
    servicer, address = engine_served
    endpoint = Endpoint(address=address, configured_roles=None)
    endpoint.connect(TransportSettings())
    endpoint.status = engine_pb2.GetStatusResponse(takes_batched_actions=takes)
    stream = EngineStream(endpoint, batches=batches)
    try:
        starts = [engine_pb2.StartGenerateRequest(request_id=f"s{i}", token_ids=[1, 2, 3]) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(stream.start(s, _NoSink()) for s in starts)), 60)
        await servicer.until_read(len(starts))
        expected = ["s0", "s1", "s2", "s3"]
        assert servicer.messages == ([expected] if merged else [[rid] for rid in expected])
    finally:
        await stream.close()
