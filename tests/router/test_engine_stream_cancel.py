"""Issue 20's suspicion, checked: a caller cancelled while its start is being written on an
engine's multiplexed Generate stream must not end that stream (grpc.aio cancels the whole call
when a task awaiting `call.write` is cancelled). A long request shares the stream with many
short ones whose callers are cancelled at every point of their start (before, during and just
after the write); the long one still streams all its tokens on the same call, nothing counts
as an engine failure and the engine stays in rotation.

Real shim process, real grpc; the router is in-process so the cancel can land on the write."""

from __future__ import annotations

import asyncio

import pytest
from router_stack import engine_alone, greedy, router_settings, wait_for

from microserving.v1 import common_pb2, engine_pb2
from router.router import Router
from router.streamed_decode import StreamedDecode

pytestmark = pytest.mark.integration

LONG_TOKENS = 120
PROMPT = [1, 70, 71, 72, 73, 74]


def _decode(router: Router, request_id: str, max_tokens: int) -> StreamedDecode[None]:
    endpoint = router.registry.endpoints[0]
    request = engine_pb2.StartGenerateRequest(
        request_id=request_id, token_ids=PROMPT, begin=0,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return StreamedDecode(router.engines, endpoint, router.engines.stream(endpoint), request)


def _failures(router: Router) -> float:
    return sum(sample.value for metric in router.metrics.engine_call_failures.collect()
               for sample in metric.samples if sample.name.endswith("_total"))


async def test_cancelling_a_caller_mid_write_leaves_the_engine_stream_alone(shims) -> None:
    router = Router(settings=router_settings([f"{shims[3].address}=both"], pattern="round-robin",
                                             first_token_timeout_s=120, inter_token_timeout_s=120))
    await router.start()
    try:
        assert await wait_for(lambda: _async(router.registry.endpoints[0].is_available), timeout_s=60)
        endpoint = router.registry.endpoints[0]
        stream = router.engines.stream(endpoint)
        long_ids: list[int] = []
        first = asyncio.Event()

        def on_long(output: engine_pb2.GenerateOutput) -> None:
            for delta in output.choices:
                long_ids.extend(delta.token_ids)
            first.set()

        long_task = asyncio.create_task(_decode(router, "long", LONG_TOKENS).run(on_long))
        await asyncio.wait_for(first.wait(), timeout=120)
        call = stream.current_call
        num_cancelled = 0
        for i in range(30):
            short = asyncio.create_task(_decode(router, f"short-{i}", 50).run(lambda _: None))
            for _ in range(i % 4):  # 0: before the write starts; then inside and after it
                await asyncio.sleep(0)
            short.cancel()
            await asyncio.gather(short, return_exceptions=True)
            num_cancelled += short.cancelled()
        await asyncio.wait_for(long_task, timeout=240)
        assert num_cancelled > 0  # the cancels did land while the callers were running
        assert stream.current_call is call and call.broken is None
        assert endpoint.is_available and _failures(router) == 0
        assert long_ids == await engine_alone(shims[3].address, PROMPT, greedy(LONG_TOKENS, ignore_eos=True),
                                              "long-alone")
    finally:
        await router.stop()


async def _async(value: bool) -> bool:
    return value
