"""Router restart under load: while clients keep sending, the router is killed (SIGKILL) and
started again on the same port. The gateway answers 503 (an OpenAI error body) for what it
cannot place, ends open streams with an error event instead of hanging, reconnects by
itself and serves again without a restart of its own."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from stack_procs import Service, free_port, start_gateway, start_router, start_shims, stop_all

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    logs = tmp_path_factory.mktemp("router-restart")
    (shim,) = start_shims(logs, ["both"])
    port = free_port()
    router = start_router(logs, [shim.address], "--pattern", "round-robin", port=port)
    gateway = start_gateway(logs, router.address)
    services: dict[str, object] = {"shim": shim, "router": router, "gateway": gateway, "logs": logs, "port": port}
    yield services
    stop_all([s for s in services.values() if isinstance(s, Service)])
    current = services["router"]
    assert isinstance(current, Service)
    current.kill()


async def _load(client: httpx.AsyncClient, statuses: Counter[int], bodies: list[str], stop: asyncio.Event,
                first_ok_after: dict[str, float], restarted: asyncio.Event) -> None:
    while not stop.is_set():
        reply = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        statuses[reply.status_code] += 1
        if reply.status_code != 200:
            bodies.append(reply.text)
            await asyncio.sleep(0.05)
        elif restarted.is_set() and "t" not in first_ok_after:
            first_ok_after["t"] = time.monotonic()


async def test_gateway_answers_503_then_reconnects_after_router_restart(stack) -> None:
    gateway, router = stack["gateway"], stack["router"]
    assert isinstance(gateway, Service) and isinstance(router, Service)
    statuses: Counter[int] = Counter()
    bodies: list[str] = []
    stop, restarted = asyncio.Event(), asyncio.Event()
    first_ok: dict[str, float] = {}
    async with httpx.AsyncClient(base_url=f"http://{gateway.address}", timeout=30) as client:
        loaders = [asyncio.ensure_future(_load(client, statuses, bodies, stop, first_ok, restarted)) for _ in range(4)]
        async with client.stream("POST", "/v1/completions", json={
            # Near the tiny model's whole context: still streaming when the router dies 0.5 s in
            # (400 tokens could finish first once the engines had a core each).
            "prompt": "long", "max_tokens": 2000, "ignore_eos": True, "stream": True, "temperature": 0,
        }) as stream:
            assert stream.status_code == 200
            lines = aiter(stream.aiter_lines())
            assert (await anext(lines)).startswith("data: ")
            await asyncio.sleep(0.5)
            router.kill()
            rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert "error" in json.loads(rest[-2][len("data: "):])  # the stream says why it ended
        await asyncio.sleep(1.5)
        assert statuses[503] > 0
        replacement = start_router(stack["logs"], [stack["shim"].address], "--pattern", "round-robin",
                                   port=stack["port"], name="router-2")
        stack["router"] = replacement
        restarted_at = time.monotonic()
        restarted.set()
        for _ in range(200):
            if "t" in first_ok:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*loaders)
    assert "t" in first_ok, statuses
    assert set(statuses) <= {200, 503}, statuses
    for body in bodies:
        error = json.loads(body)["error"]
        assert error["type"] == "service_unavailable_error" and "Traceback" not in body
    assert gateway.is_alive()
    print(f"\nrouter restart: {statuses[200]} x 200, {statuses[503]} x 503; serving again "
          f"{first_ok['t'] - restarted_at:.2f} s after the new router listened")
