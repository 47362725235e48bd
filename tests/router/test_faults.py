"""Faults: a decode shim killed before its first token makes the router retry elsewhere and
the request succeed; a stalled engine leaves rotation at its stage deadline; errors of one
request never break the others. These tests start (and kill) shims of their own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
from router_stack import (
    Shim,
    engine_alone,
    engine_status,
    generate,
    greedy,
    kill_all,
    router_settings,
    running_router,
    start_shims,
    wait_for,
)

from microserving.tokenizer import Tokenizer
from microserving.v1 import router_pb2
from router.router import Router

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def own_shims() -> Iterator[list[Shim]]:
    started = start_shims(["prefill", "decode", "decode", "both"])
    yield started
    kill_all(started)


async def test_killed_decode_shim_before_first_token_is_retried_elsewhere(own_shims) -> None:
    prefill, doomed, healthy, _ = own_shims
    engines = [f"{prefill.address}=prefill", f"{doomed.address}=decode", f"{healthy.address}=decode"]
    # A long health interval: only the failed call (not a health probe) can take it out.
    router = Router(settings=router_settings(engines, pattern="disagg", health_interval_s=120))
    prompts = ["first request through the doomed engine", "second request elsewhere"]
    p_free = (await engine_status(prefill.address)).num_free_kv_pages
    async with running_router(router) as (_, stub):
        doomed.pause()  # frozen: the router's PrepRecv waits on it (P's send, made with it, waits too)
        task = asyncio.ensure_future(generate(stub, *(
            router_pb2.NewRequest(request_id=str(i), text=p, sampling=greedy()) for i, p in enumerate(prompts)
        )))
        endpoint = router.registry.get(doomed.address)
        assert endpoint is not None

        async def waiting_on_doomed() -> bool:
            return endpoint.num_inflight > 0

        assert await wait_for(waiting_on_doomed)
        doomed.kill()
        results = await task
        status = await stub.GetStatus(router_pb2.RouterGetStatusRequest())
    tokenizer = Tokenizer.from_model("tiny")
    for i, prompt in enumerate(prompts):
        want = await engine_alone(healthy.address, tokenizer.encode(prompt), greedy(), f"fault-alone-{i}")
        assert results[str(i)].error is None, results[str(i)].error
        assert results[str(i)].token_ids == want
        assert doomed.address not in results[str(i)].done.engines
    health = {e.address: e.health for e in status.engines}
    assert health[doomed.address] == router_pb2.ENGINE_HEALTH_UNREACHABLE
    assert health[healthy.address] == router_pb2.ENGINE_HEALTH_SERVING

    async def p_holds_nothing() -> bool:  # the send made for the doomed engine was undone
        return (await engine_status(prefill.address)).num_free_kv_pages == p_free

    assert await wait_for(p_holds_nothing, timeout_s=5)


async def test_stalled_engine_leaves_rotation_at_its_deadline_and_returns_when_healthy(own_shims) -> None:
    healthy, stalled = own_shims[2], own_shims[3]
    engines = [f"{healthy.address}=both", f"{stalled.address}=both"]
    settings = router_settings(engines, pattern="round-robin", first_token_timeout_s=3.0,
                               health_interval_s=6.0, health_timeout_s=1.0)  # only the deadline can catch it first
    router = Router(settings=settings)
    async with running_router(router) as (_, stub):
        stalled.pause()
        try:
            results = await generate(stub, *(
                router_pb2.NewRequest(request_id=str(i), text=f"stall {i}", sampling=greedy()) for i in range(2)
            ))
            status = await stub.GetStatus(router_pb2.RouterGetStatusRequest())
        finally:
            stalled.resume()
        endpoint = router.registry.get(stalled.address)
        assert endpoint is not None

        async def back_in_rotation() -> bool:
            return endpoint.is_available

        assert await wait_for(back_in_rotation, timeout_s=20)
    assert all(r.error is None and list(r.done.engines) == [healthy.address] for r in results.values())
    health = {e.address: e.health for e in status.engines}
    assert health[stalled.address] == router_pb2.ENGINE_HEALTH_UNREACHABLE


async def test_request_fails_cleanly_when_no_engine_is_left(own_shims) -> None:
    dead = own_shims[1]  # killed by the test above, or dead anyway
    dead.kill()
    router = Router(settings=router_settings([f"{dead.address}=both"], pattern="round-robin", health_interval_s=120))
    async with running_router(router) as (_, stub):
        results = await generate(stub, router_pb2.NewRequest(request_id="n", text="anyone?", sampling=greedy()))
    error = results["n"].error
    assert error is not None and error.code == grpc.StatusCode.UNAVAILABLE.value[0]


async def test_an_engine_that_failed_a_call_but_answers_is_back_in_rotation_at_once(own_shims) -> None:
    """A failed call takes its engine out of rotation, and its health check comes at once,
    not an interval later: the only engine of a role, alive but failing one call (a KV write
    that timed out under load), no longer leaves every request of the interval to "no healthy
    engine". A dead engine stays out (the test above); so does a stalled one (its check times
    out, test_stalled_...)."""
    engine = own_shims[2]  # alive: the healthy one of the stall test
    router = Router(settings=router_settings([f"{engine.address}=both"], pattern="round-robin",
                                             health_interval_s=120))  # only the failure brings a check
    async with running_router(router) as (_, stub):
        endpoint = router.registry.get(engine.address)
        assert endpoint is not None and endpoint.is_available
        # Before this change the monitor checked again right after start: let any such check
        # end first, or it, not the failure's recheck, would put the engine back.
        await asyncio.sleep(1.0)
        router.engines.call_failed_with(grpc.StatusCode.UNAVAILABLE, "KV write to agent x did not complete",
                                        engine.address, "remote_send")
        assert not endpoint.is_available  # out of rotation, as before

        async def back_in_rotation() -> bool:
            return endpoint.is_available

        assert await wait_for(back_in_rotation, timeout_s=30)  # well inside the 120 s interval
        results = await generate(stub, router_pb2.NewRequest(request_id="back", text="back again",
                                                             sampling=greedy()))
    assert results["back"].error is None and list(results["back"].done.engines) == [engine.address]
