"""Several processes per service, as `microserving up` starts them on a big host: a gateway with
two worker processes in front of two router replicas over one engine. Real entry points; the
official `openai` client. Requests spread over both routers, every answer is the engine's own
(temperature 0), and /metrics, whichever worker answers it, counts every worker's requests."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from stack_procs import (  # noqa: E402
    Service,
    router_status,
    start_gateway,
    start_router,
    start_shims,
    stop_all,
    wait_until,
)

pytestmark = pytest.mark.e2e
NUM_REQUESTS = 8


@pytest.fixture(scope="module")
def scaled_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, list[Service]]]:
    log_dir = tmp_path_factory.mktemp("scaling")
    services: list[Service] = []
    try:
        services += start_shims(log_dir, ["both"])
        engine = services[0].address
        routers = [start_router(log_dir, [engine], "--pattern", "round-robin", name=f"router-{i}")
                   for i in range(2)]
        services += routers
        gateway = start_gateway(log_dir, ",".join(r.address for r in routers), "--workers", "2")
        services.append(gateway)
        yield gateway, routers
    finally:
        stop_all(reversed(services))


async def _completion_requests_counted(base_url: str) -> float:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        text = (await http.get("/metrics")).text
    match = re.search(r'^microserving_gateway_requests_total\{endpoint="/v1/completions",'
                      r'status="200"\} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def test_workers_and_router_replicas_serve_together(scaled_stack) -> None:
    gateway, routers = scaled_stack
    base_url = f"http://{gateway.address}"
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                http_client=httpx.AsyncClient(timeout=120))
    seen_busy: set[int] = set()

    async def watch_routers() -> bool:
        for index, router in enumerate(routers):
            if (await router_status(router.address)).num_inflight_requests > 0:
                seen_busy.add(index)
        return len(seen_busy) == len(routers)

    async def one(i: int) -> str:
        stream = await client.completions.create(
            # Long enough to stay in flight across many of the watcher's polls (64 tokens could
            # come and go between two of them once engines stepped fast).
            model="tiny", prompt="scaling across processes", max_tokens=1000, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    # Each worker opens a call on every replica before it reuses one, so concurrent requests
    # land on both routers; clients connect anew, so the kernel spreads them over the workers.
    tasks = [asyncio.ensure_future(one(i)) for i in range(NUM_REQUESTS)]
    watcher = await wait_until(watch_routers, timeout_s=120, interval_s=0.05)
    texts = await asyncio.gather(*tasks)
    await client.close()
    assert watcher is not None, f"only routers {sorted(seen_busy)} ever had requests in flight"
    assert len(set(texts)) == 1 and len(texts[0]) > 0  # greedy: the same answer every time
    # Every worker's requests, summed, whichever worker answers the scrape.
    for _ in range(4):
        assert await _completion_requests_counted(base_url) == NUM_REQUESTS
