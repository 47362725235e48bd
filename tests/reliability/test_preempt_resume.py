"""A KV pool that fills mid-decode: running requests are preempted and still end with exactly
the tokens each gets alone. The decode shim has a pool of NUM_PAGES pages, far less than
the requests sent at once need by their last token, so the engine runs out of pages while
they decode:

- data parallel (one engine, no KV from elsewhere): the engine preempts the newest running
  sequence and recomputes it later from prompt + tokens generated so far;
- disagg (P computes the prompt's KV, D decodes): a preempted sequence's KV came from P, so
  D ends it with FINISH_REASON_PREEMPT and the router runs the pattern again from prompt +
  tokens already streamed (a resume), as MLC's router does.

Every client sees its reference tokens (the same request alone on the same engine, before the
burst), no error, and the preemptions are counted (shim and router /metrics), so the test
cannot pass without preempting. Afterwards every page is free again.

Stack: P and D shims (processes), one data-parallel router on D and one disagg router over P
and D, Router.Generate clients."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from stack_procs import (
    Service,
    Tracked,
    engine_status,
    greedy,
    pages_at_baseline,
    start_router,
    start_shims,
    stop_all,
    track,
    wait_until,
)

from microserving.transport import TransportSettings, create_channel
from microserving.v1 import router_pb2, router_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_e2e_metrics import metrics_url, scrape  # noqa: E402

pytestmark = pytest.mark.e2e

NUM_PAGES, PAGE_SIZE = 24, 16
MAX_TOKENS = 300
# ~46 prompt tokens + 300 generated: 22 pages each by the end, so one request fits alone;
# two decoding side by side fill the pool about 100 tokens after the second one starts.
PROMPTS = [f"preempt me {i}: the quick brown fox jumps over" for i in range(3)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("preempt-resume")
    services: list[Service] = []
    try:
        (prefill,) = start_shims(logs, ["prefill"], "--enable-prefix-cache", "false", prefix="p")
        (decode,) = start_shims(logs, ["both"], "--num-pages", str(NUM_PAGES), "--enable-prefix-cache", "false",
                                "--metrics-port", "0", prefix="d")
        services += [prefill, decode]
        data_parallel = start_router(logs, [decode.address], "--metrics-port", "0", name="router-dp")
        services.append(data_parallel)
        disagg = start_router(logs, [f"{prefill.address}=prefill", f"{decode.address}=decode"],
                              "--pattern", "disagg", "--metrics-port", "0", name="router-disagg")
        services.append(disagg)
        yield {"prefill": prefill, "decode": decode, "data_parallel": data_parallel, "disagg": disagg}
    finally:
        stop_all(services)


def _shim_preemptions(decode: Service) -> float:
    return scrape(metrics_url(decode))[("microserving_shim_preemptions_total", ())]


def _router_preemptions(router: Service) -> float:
    return scrape(metrics_url(router))[("microserving_router_preemptions_total", ())]


async def _run(router: Service, prompts: list[str], tag: str) -> list[Tracked]:
    """Send the first prompt; once it streams, the others: they meet it on the engine
    while it still has most of its tokens to go (a loaded machine cannot serialise them)."""
    async with create_channel(router.address, TransportSettings()) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        records = [Tracked(f"{tag}-{i}", []) for i in range(len(prompts))]
        requests = [router_pb2.NewRequest(request_id=r.request_id, text=p, sampling=greedy(MAX_TOKENS))
                    for r, p in zip(records, prompts, strict=True)]
        first = asyncio.ensure_future(track(stub, requests[0], records[0], timeout_s=300))

        async def first_streams() -> bool:
            return bool(records[0].token_ids) or first.done()

        await wait_until(first_streams, timeout_s=120)
        rest = (track(stub, q, r, timeout_s=300) for q, r in zip(requests[1:], records[1:], strict=True))
        await asyncio.gather(first, *rest)
        return records


async def _references(router: Service) -> list[list[int]]:
    """Each prompt alone (one at a time: a request fits the pool by itself)."""
    references = []
    for i, prompt in enumerate(PROMPTS):
        (record,) = await _run(router, [prompt], f"alone-{i}")
        assert record.done is not None and not record.error and not record.rpc_error, record
        assert len(record.token_ids) == MAX_TOKENS
        references.append(record.token_ids)
    return references


def _assert_exact(records: list[Tracked], references: list[list[int]]) -> None:
    for record, reference in zip(records, references, strict=True):
        assert record.error is None and not record.rpc_error, (record.request_id, record.error, record.rpc_error)
        assert record.done is not None, record.request_id
        assert record.token_ids == reference, (record.request_id, len(record.token_ids), record.done)


async def test_data_parallel_requests_preempted_mid_decode_are_recomputed_token_exact(stack) -> None:
    decode, router = stack["decode"], stack["data_parallel"]
    baseline = (await engine_status(decode.address)).num_free_kv_pages
    references = await _references(router)
    before = _shim_preemptions(decode)
    records = await _run(router, PROMPTS, "dp")
    preemptions = _shim_preemptions(decode) - before
    print(f"\ndata parallel: {preemptions:.0f} preemptions on a {NUM_PAGES}-page pool, {len(records)} requests exact")
    assert preemptions > 0
    _assert_exact(records, references)
    assert await pages_at_baseline([decode.address], [baseline], within_s=10) == [baseline]


async def test_disagg_requests_preempted_mid_decode_are_resumed_token_exact(stack) -> None:
    decode, router = stack["decode"], stack["disagg"]
    baseline = (await engine_status(decode.address)).num_free_kv_pages
    references = await _references(router)
    shim_before, router_before = _shim_preemptions(decode), _router_preemptions(router)
    records = await _run(router, PROMPTS, "pd")
    resumes = _router_preemptions(router) - router_before
    print(f"\ndisagg: {_shim_preemptions(decode) - shim_before:.0f} preemptions on D, {resumes:.0f} "
          f"resumed through the pattern, {len(records)} requests exact")
    assert resumes > 0
    _assert_exact(records, references)
    assert await pages_at_baseline([decode.address], [baseline], within_s=10) == [baseline]
