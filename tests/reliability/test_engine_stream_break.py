"""The router's long-lived Engine.Generate stream to a decode shim breaks (the shim is killed)
while requests on it have no token yet: those requests fail on that stream with UNAVAILABLE
and are retried on the other engine, token-exact; the dead engine leaves rotation; the other
engine's stream carries on.

Stack: two shims (processes, both roles), the router (process, round-robin, engine stream on)
and a Router.Generate client per request."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from stack_procs import (
    Service,
    Tracked,
    engine_health,
    greedy,
    router_status,
    start_router,
    start_shims,
    stop_all,
    track,
    wait_until,
)

from microserving.transport import TransportSettings, create_channel
from microserving.v1 import router_pb2, router_pb2_grpc

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24
PROMPTS = [f"stream break {i}: pack my box with five dozen liquor jugs" for i in range(4)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs: Path = tmp_path_factory.mktemp("engine-stream-break")
    doomed, survivor = start_shims(logs, ["both", "both"])
    # Long health interval: only the broken stream takes the killed engine out of rotation.
    router = start_router(
        logs, [f"{doomed.address}=both", f"{survivor.address}=both"],
        "--pattern", "round-robin", "--engine-stream", "--health-interval-s", "60",
        "--first-token-timeout-s", "60",
    )
    services = {"doomed": doomed, "survivor": survivor, "router": router}
    yield services
    stop_all(services.values())


def _request(rid: str, prompt: str) -> router_pb2.NewRequest:
    return router_pb2.NewRequest(request_id=rid, text=prompt, sampling=greedy(MAX_TOKENS))


async def test_requests_on_a_broken_engine_stream_are_retried_elsewhere_token_exact(stack) -> None:
    router, doomed = stack["router"], stack["doomed"]
    async with create_channel(router.address, TransportSettings()) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        # Opens the router's stream to both engines (ties rotate) and gives the reference.
        reference = [await track(stub, _request(f"ref{i}", p), Tracked(f"ref{i}", [])) for i, p in enumerate(PROMPTS)]
        assert all(r.error is None and len(r.token_ids) == MAX_TOKENS for r in reference), reference
        assert {e for r in reference for e in r.done.engines} == {doomed.address, stack["survivor"].address}

        doomed.pause()  # requests sent to it now get no first token
        records = [Tracked(f"r{i}", []) for i in range(len(PROMPTS))]
        tasks = [asyncio.ensure_future(track(stub, _request(r.request_id, p), r))
                 for p, r in zip(PROMPTS, records, strict=True)]
        # Until the router has requests waiting on the frozen engine (a fixed sleep was too
        # short for a loaded machine: none had reached it yet, so nothing was retried).
        assert await wait_until(lambda: _is_waiting_on(router.address, doomed.address), timeout_s=60) is not None
        doomed.kill()  # breaks the stream under the waiting requests
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

    for record, want in zip(records, reference, strict=True):
        assert record.error is None and not record.rpc_error, (record.error, record.rpc_error)
        assert record.token_ids == want.token_ids, record.request_id
        assert record.done is not None and list(record.done.engines) == [stack["survivor"].address]
    # Retried because the stream broke (UNAVAILABLE), not because a deadline passed.
    retried = re.findall(r"retrying (r\d) elsewhere after start_generate on " + re.escape(doomed.address)
                         + r" failed: UNAVAILABLE", router.log())
    assert retried, router.log()[-3000:]
    health = await engine_health(router.address)
    assert health[doomed.address] == router_pb2.ENGINE_HEALTH_UNREACHABLE


async def _is_waiting_on(router_address: str, engine_address: str) -> bool:
    engines = (await router_status(router_address)).engines
    return any(e.address == engine_address and e.num_inflight_decode > 0 for e in engines)


async def test_the_survivor_keeps_serving_on_its_own_stream(stack) -> None:
    """One engine's stream breaking leaves the other engine's stream serving."""
    router = stack["router"]
    async with create_channel(router.address, TransportSettings()) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        record = await track(stub, _request("after", PROMPTS[0]), Tracked("after", []))

    async def served() -> bool:
        return record.done is not None

    assert await wait_until(served, 5) is not None
    assert len(record.token_ids) == MAX_TOKENS
