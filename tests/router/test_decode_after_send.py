"""The router's end of a decode that starts with its KV's sender (engine_calls.decode_after):
a real shim holds a PrepRecv reservation and the waiting start; the sender is a coroutine the
test controls (what P's RemoteSend would be). When the transfer fails, D's start fails too,
often first: the decode's error is then the sender's (its code and its engine, which the
runner retries on and takes out of rotation), not D's FAILED_PRECONDITION, which would end the
request for the client. The first-token deadline counts only from the sender's return: a
sender that takes longer than it is not the decode engine's fault."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest
from router_stack import greedy, router_settings, wait_for

from microserving.transport import TransportSettings, create_channel
from microserving.v1 import engine_pb2, engine_pb2_grpc
from router.errors import EngineCallError
from router.router import Router
from router.streamed_decode import StreamedDecode

pytestmark = pytest.mark.integration

_ids = itertools.count()
PROMPT = [1, *range(200, 240)]
SENDER = "127.0.0.1:9"  # the engine the (test's) sender stands for


async def _reserve(address: str, request_id: str) -> engine_pb2.PrepRecvResponse:
    async with create_channel(address, TransportSettings()) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        return await stub.PrepRecv(engine_pb2.PrepRecvRequest(
            request_id=request_id, token_ids=PROMPT, end=-1, sampling=greedy()), timeout=30)


async def _abort(address: str, request_id: str) -> None:
    async with create_channel(address, TransportSettings()) as channel:
        await engine_pb2_grpc.EngineStub(channel).Abort(engine_pb2.AbortRequest(request_id=request_id), timeout=30)


def _decode_after(router: Router, request_id: str, begin: int, send) -> StreamedDecode[None]:
    endpoint = router.registry.endpoints[0]
    request = engine_pb2.StartGenerateRequest(request_id=request_id, token_ids=PROMPT, begin=begin,
                                              sampling=greedy(), after_kv_transfer=True)
    return StreamedDecode(router.engines, endpoint, router.engines.stream(endpoint), request, after=send)


async def _router(address: str, **values) -> Router:
    router = Router(settings=router_settings([f"{address}=decode"], pattern="round-robin", **values))
    await router.start()

    async def ready() -> bool:
        return router.registry.endpoints[0].is_available

    assert await wait_for(ready, timeout_s=60)
    return router


async def test_a_failed_send_is_the_decodes_error_even_when_the_decode_engine_fails_first(shims) -> None:
    address = shims[3].address
    router = await _router(address)
    try:
        request_id = f"after-kv-fail-{next(_ids)}"
        prep = await _reserve(address, request_id)
        release = asyncio.Event()

        async def failing_send() -> None:
            await release.wait()
            raise router.engines.call_failed_with(grpc.StatusCode.UNAVAILABLE, "the sender died",
                                                  SENDER, "remote_send")

        decode = _decode_after(router, request_id, prep.end, failing_send)
        running = asyncio.ensure_future(decode.run(lambda _: None))
        # The reservation ends without its KV: D's waiting start fails (FAILED_PRECONDITION).
        await asyncio.sleep(0.2)
        await _abort(address, request_id)

        async def decode_engine_failed() -> bool:
            return any(sample.value > 0 and sample.labels == {
                "engine": address, "call": "start_generate", "code": "FAILED_PRECONDITION"}
                for metric in router.metrics.engine_call_failures.collect()
                for sample in metric.samples if sample.name.endswith("_total"))

        assert await wait_for(decode_engine_failed, timeout_s=30)
        assert not running.done()  # held for the sender's outcome
        release.set()
        with pytest.raises(EngineCallError) as failed:
            await asyncio.wait_for(running, timeout=30)
        assert (failed.value.code, failed.value.address, failed.value.stage) == (
            grpc.StatusCode.UNAVAILABLE, SENDER, "remote_send")
        assert failed.value.is_retryable
        assert router.registry.endpoints[0].is_available  # the decode engine stays in rotation
    finally:
        await router.stop()


async def test_the_first_token_deadline_starts_when_the_send_returns(shims) -> None:
    address = shims[3].address
    router = await _router(address, first_token_timeout_s=0.5)
    try:
        request_id = f"after-kv-deadline-{next(_ids)}"
        prep = await _reserve(address, request_id)
        sent = asyncio.Event()

        async def slow_send() -> None:
            await sent.wait()  # returns without the KV having moved: D never starts

        decode = _decode_after(router, request_id, prep.end, slow_send)
        running = asyncio.ensure_future(decode.run(lambda _: None))
        await asyncio.sleep(1.5)  # three first-token deadlines
        assert not running.done()
        sent.set()
        with pytest.raises(EngineCallError) as failed:
            await asyncio.wait_for(running, timeout=30)
        # now the decode engine's deadline, which ran out
        assert (failed.value.code, failed.value.stage) == (grpc.StatusCode.DEADLINE_EXCEEDED, "start_generate")
    finally:
        await router.stop()
        await _abort(address, request_id)
