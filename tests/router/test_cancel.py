"""Cancellation: a cancelled request ends with finish ABORT and done, its Abort reaches every
engine it touched (free KV pages return to baseline, reservations included), and the other
requests of the same stream carry on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from router_stack import (
    Result,
    collect,
    engine_alone,
    engine_status,
    greedy,
    router_settings,
    running_router,
    wait_for,
)

from microserving.tokenizer import Tokenizer
from microserving.v1 import common_pb2, router_pb2
from router.router import Router

pytestmark = pytest.mark.integration


async def _free_pages(addresses: list[str]) -> list[int]:
    return [(await engine_status(a)).num_free_kv_pages for a in addresses]


def _long(request_id: str, text: str) -> router_pb2.NewRequest:
    return router_pb2.NewRequest(request_id=request_id, text=text, sampling=greedy(max_tokens=200, ignore_eos=True))


async def _run_stream(stub, starts: list[router_pb2.NewRequest], cancel_id: str, after_first_delta: bool) -> dict[str, Result]:
    outgoing: asyncio.Queue[router_pb2.GenerateRequest | None] = asyncio.Queue()
    for start in starts:
        outgoing.put_nowait(router_pb2.GenerateRequest(generate=start))
    if not after_first_delta:
        outgoing.put_nowait(router_pb2.GenerateRequest(cancel=router_pb2.CancelRequest(request_id=cancel_id)))

    async def messages() -> AsyncIterator[router_pb2.GenerateRequest]:
        while (item := await outgoing.get()) is not None:
            yield item

    results = {s.request_id: Result() for s in starts}
    num_done = 0
    async for message in stub.Generate(messages(), timeout=120):
        result = results[message.request_id]
        first = message.HasField("delta") and result.num_deltas == 0
        collect(result, message)
        if first and after_first_delta and message.request_id == cancel_id:
            outgoing.put_nowait(router_pb2.GenerateRequest(cancel=router_pb2.CancelRequest(request_id=cancel_id)))
        if message.HasField("done") or message.HasField("error"):
            num_done += 1
            if num_done == len(starts):
                outgoing.put_nowait(None)
    return results


@pytest.mark.parametrize("after_first_delta", [True, False], ids=["mid-stream", "before-first-token"])
async def test_cancelled_request_leaves_every_engine_at_baseline_free_pages(shims, after_first_delta: bool) -> None:
    addresses = [shims[0].address, shims[1].address]
    engines = [f"{addresses[0]}=prefill", f"{addresses[1]}=decode"]
    baseline = await _free_pages(addresses)
    async with running_router(Router(settings=router_settings(engines, pattern="disagg"))) as (_, stub):
        results = await _run_stream(stub, [_long("x", f"cancel me {after_first_delta} " * 8)], "x", after_first_delta)
    got = results["x"]
    assert got.error is None and got.done is not None
    assert got.finish[0] == common_pb2.FINISH_REASON_ABORT
    assert len(got.token_ids) < 200

    async def back_to_baseline() -> bool:
        return await _free_pages(addresses) == baseline

    assert await wait_for(back_to_baseline), (baseline, await _free_pages(addresses))
    statuses = [await engine_status(a) for a in addresses]
    assert all(s.num_reserved_requests == 0 and s.num_running_requests == 0 for s in statuses)


async def test_other_requests_on_the_stream_carry_on_after_a_cancel(shims) -> None:
    engines = [f"{shims[0].address}=both", f"{shims[1].address}=both"]
    keep = router_pb2.NewRequest(request_id="keep", text="I am not cancelled.", sampling=greedy())
    async with running_router(Router(settings=router_settings(engines, pattern="round-robin"))) as (_, stub):
        results = await _run_stream(stub, [_long("drop", "cancel only me " * 4), keep], "drop", True)
    want = await engine_alone(shims[2].address, Tokenizer.from_model("tiny").encode(keep.text), greedy(), "keep-alone")
    assert results["drop"].finish[0] == common_pb2.FINISH_REASON_ABORT
    assert results["keep"].error is None and results["keep"].token_ids == want
