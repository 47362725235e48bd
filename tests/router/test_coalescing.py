"""Coalescing on the token path: when a consumer lags, the deltas queued for it are merged
(Router.GenerateBatched's batches at the router, the gateway's per-request inbox, the SSE
layer's merge per choice) and carry exactly the tokens, text, logprobs and finish reasons that
a consumer keeping up receives one step at a time, in order. Real shims and a real router; the
gateway's own router client and relay on the consuming side."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest
from router_stack import greedy, router_settings, running_router

from gateway.metrics import GatewayMetrics
from gateway.router_client import RouterClient
from gateway.serving.events import DeltaEvent, UsageTotals, relay
from microserving.transport import TransportSettings
from microserving.v1 import common_pb2, router_pb2
from router.router import Router

pytestmark = pytest.mark.integration


@dataclass
class Received:
    num_batches: int = 0
    num_deltas: dict[int, int] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    logprob_ids: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    usage: UsageTotals | None = None


async def _receive(client: RouterClient, request: router_pb2.NewRequest, n: int,
                   lag_s: float) -> Received:
    """One request through the gateway's relay; with `lag_s`, nothing is read for that long
    after the first batch (the engine keeps producing meanwhile)."""
    received = Received()
    async with client.open_stream() as stream:
        async for batch in relay(stream, [request], n, GatewayMetrics(), time.perf_counter()):
            if isinstance(batch, UsageTotals):
                received.usage = batch
                continue
            received.num_batches += 1
            for event in batch:
                assert isinstance(event, DeltaEvent)
                index = event.index
                assert received.finish.get(index) is None, "nothing may follow a choice's finish"
                received.num_deltas[index] = received.num_deltas.get(index, 0) + 1
                received.token_ids.setdefault(index, []).extend(event.token_ids)
                received.text[index] = received.text.get(index, "") + event.text
                received.logprob_ids.setdefault(index, []).extend(lp.token_id for lp in event.logprobs)
                received.finish[index] = event.finish_reason
            if lag_s and received.num_batches == 1:
                # This request's task falls behind (as behind a slow HTTP client) while the
                # stream's reader keeps delivering into its inbox.
                await asyncio.sleep(lag_s)
    return received


@pytest.mark.parametrize("pattern", ["round-robin", "disagg"])
@pytest.mark.parametrize("sampling", [
    greedy(48, ignore_eos=True, logprobs=True),
    common_pb2.SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=40, ignore_eos=True),
], ids=["greedy-logprobs", "seeded-n2"])
async def test_coalesced_deltas_carry_exactly_the_tokens_of_uncoalesced_ones(
    shims, pattern: str, sampling: common_pb2.SamplingParams
) -> None:
    engines = [f"{shims[0].address}=prefill", f"{shims[1].address}=decode"] \
        if pattern == "disagg" else [shims[0].address]
    n = sampling.n if sampling.HasField("n") else 1
    prompt = router_pb2.TokenIds(ids=[5, 17, 99, 3, 42, 8, 61, 200, 12, 7])
    async with running_router(Router(settings=router_settings(engines, pattern=pattern))) as (running, _):
        client = RouterClient(f"127.0.0.1:{running.port}", TransportSettings())
        try:
            steady = await _receive(client, router_pb2.NewRequest(
                request_id="steady", token_ids=prompt, sampling=sampling), n, lag_s=0.0)
            lagging = await _receive(client, router_pb2.NewRequest(
                request_id="lagging", token_ids=prompt, sampling=sampling), n, lag_s=1.5)
        finally:
            await client.close()
    max_tokens = sampling.max_tokens
    for index in range(n):
        assert len(steady.token_ids[index]) == max_tokens
        assert lagging.token_ids[index] == steady.token_ids[index]
        assert lagging.text[index] == steady.text[index]
        assert lagging.logprob_ids[index] == steady.logprob_ids[index]
        assert lagging.finish[index] == steady.finish[index] == "length"
        # The lag merged what queued meanwhile into fewer deltas than tokens.
        assert lagging.num_deltas[index] < max_tokens
    if sampling.logprobs:
        assert lagging.logprob_ids[0] == lagging.token_ids[0]
    assert lagging.usage is not None and steady.usage is not None
    assert lagging.usage.completion_tokens == steady.usage.completion_tokens == n * max_tokens
