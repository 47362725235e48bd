"""Engine death mid-stream: a decode shim killed with SIGKILL while requests stream through
the router. Requests it held that had no token yet are retried on the other decode engine;
requests that had streamed tokens are resumed there from prompt + tokens already sent, and at
temperature 0 every client's final tokens equal the no-fault reference. When no decode engine
is left, streaming requests end promptly with UNAVAILABLE. Nothing hangs.

Stack: one prefill and two decode shims (processes), the router (process, disagg) and a
Router.Generate client per request."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from stack_procs import (
    Service,
    Tracked,
    engine_health,
    engine_status,
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

# Within the tiny model's context, beside these prompts. Long enough that every request is
# still streaming when the next is placed, even on a loaded machine: placement is by load.
MAX_TOKENS = 1500
PROMPTS = [f"request {i}: the quick brown fox jumps over the lazy dog" for i in range(9)]
# Wave A streams before the fault, wave B arrives while the doomed engine is frozen (as many
# of it as it takes for one to land there).
WAVE_A, WAVE_B = PROMPTS[:3], PROMPTS[3:]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs: Path = tmp_path_factory.mktemp("engine-death")
    # No status poll after the router's first (an hour apart, the KV peers it tells the shims
    # kept as long): only failed calls take the killed engine out of rotation. With polls a
    # minute apart, a loaded machine could take the test past the next one while the doomed
    # engine was frozen: that poll failed, the engine left rotation, and no wave-B request
    # could reach it (a CI run under load: "no request of wave B reached the frozen engine").
    prefill, decode_a, decode_b = start_shims(logs, ["prefill", "decode", "decode"],
                                              "--kv-peer-ttl-s", "3600")
    router = start_router(
        logs, [f"{prefill.address}=prefill", f"{decode_a.address}=decode", f"{decode_b.address}=decode"],
        "--pattern", "disagg", "--health-interval-s", "3600", "--inter-token-timeout-s", "20",
    )
    services = {"prefill": prefill, "doomed": decode_a, "survivor": decode_b, "router": router}
    yield services
    stop_all(services.values())


def _request(i: int, prompt: str) -> router_pb2.NewRequest:
    return router_pb2.NewRequest(request_id=f"r{i}", text=prompt, sampling=greedy(MAX_TOKENS))


async def _run_all(stub: router_pb2_grpc.RouterStub, prompts: list[str], offset: int = 0) -> list[Tracked]:
    records = [Tracked(f"r{offset + i}", []) for i in range(len(prompts))]
    await asyncio.gather(*(track(stub, _request(offset + i, p), r) for i, (p, r) in enumerate(zip(prompts, records, strict=False))))
    return records


async def _inflight(router: Service) -> dict[str, int]:
    """Requests the router has on each engine now, every stage."""
    status = await router_status(router.address)
    return {e.address: e.num_inflight_prefill + e.num_inflight_decode for e in status.engines}


async def test_killed_decode_engine_requests_are_retried_or_resumed_token_exact(stack) -> None:
    router = stack["router"]
    async with create_channel(router.address, TransportSettings()) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        reference = await _run_all(stub, PROMPTS)
        assert all(r.error is None and len(r.token_ids) == MAX_TOKENS for r in reference), reference

        wave_a = [Tracked(f"a{i}", []) for i in range(len(WAVE_A))]
        tasks = [asyncio.ensure_future(track(stub, _request(i, p), r)) for i, (p, r) in enumerate(zip(WAVE_A, wave_a, strict=False))]

        async def all_streaming() -> bool:
            return all(len(r.token_ids) >= 2 for r in wave_a)

        assert await wait_until(all_streaming, 60) is not None
        # The engine to kill holds streaming requests, the fewer the better: new requests go
        # to the least-loaded engine (placement is by load, which the engines also report, so
        # which one is not fixed in advance).
        inflight = await _inflight(router)
        decoders = [stack["doomed"], stack["survivor"]]
        decoders.sort(key=lambda s: (inflight.get(s.address, 0) == 0, inflight.get(s.address, 0)))
        doomed, survivor = decoders
        stack["doomed"], stack["survivor"] = doomed, survivor  # for the next test
        assert inflight.get(doomed.address, 0) >= 1, inflight
        doomed.pause()  # its requests stop streaming; the others carry on
        # Wave B, one request at a time until one sits on the frozen engine with no token yet
        # (each goes to the least-loaded engine; the survivor's load only grows, so one lands
        # there within a few).
        wave_b: list[Tracked] = []
        for i, prompt in enumerate(WAVE_B):
            before = await _inflight(router)
            wave_b.append(Tracked(f"b{i}", []))
            tasks.append(asyncio.ensure_future(track(stub, _request(len(WAVE_A) + i, prompt), wave_b[-1])))

            now: dict[str, int] = {}

            async def placed(before: dict[str, int] = before, record: Tracked = wave_b[-1],
                             now: dict[str, int] = now) -> bool:
                now.update(await _inflight(router))
                return sum(now.values()) > sum(before.values()) or bool(record.token_ids) or record.done is not None

            assert await wait_until(placed, 60) is not None, f"request b{i} reached no engine"
            if now.get(doomed.address, 0) > before.get(doomed.address, 0):
                break
        else:
            raise AssertionError("no request of wave B reached the frozen engine")
        await asyncio.sleep(1.0)
        killed_at = time.monotonic()
        doomed.kill()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)

    records = [*wave_a, *wave_b]
    # The router says which requests it moved: "resuming" (tokens streamed) or "retrying".
    log = router.log()
    resumed = set(re.findall(r"resuming (r\d+) elsewhere after \S+ on " + re.escape(doomed.address), log))
    retried = set(re.findall(r"retrying (r\d+) elsewhere after \S+ on " + re.escape(doomed.address), log))
    for i, (record, want) in enumerate(zip(records, reference, strict=False)):
        assert record.error is None and not record.rpc_error, (record.error, record.rpc_error)
        assert record.token_ids == want.token_ids, record.request_id  # no duplicated or lost text
        assert record.text == want.text
        assert record.done is not None
        # The engines of the attempt that finished: never the doomed one, unless a wave-A
        # request finished there before it froze (then it was never moved, and the survivor
        # had no part in it): an engine frozen and then killed produces no token after that.
        engines = list(record.done.engines)
        if doomed.address in engines:
            assert record.request_id.startswith("a") and survivor.address not in engines, (
                record.request_id, engines)
            assert f"r{i}" not in resumed | retried, (record.request_id, engines)
    assert resumed, "no streaming request was on the killed engine"
    assert retried, ("no request without tokens was on the killed engine", re.findall(r".*elsewhere.*", log))
    assert "remote_send on " + stack["prefill"].address not in log
    worst_s = max(r.ended_at_s for r in records) - killed_at
    print(f"\nengine death: {len(records)} requests survived ({len(resumed)} resumed after streaming, "
          f"{len(retried)} with no token yet retried); all done {worst_s:.2f} s after the kill")
    health = await engine_health(router.address)
    assert health[doomed.address] == router_pb2.ENGINE_HEALTH_UNREACHABLE
    # A KV push that failed because its receiver died is the receiver's fault, not the
    # prefill engine's, which stays in rotation.
    assert health[stack["prefill"].address] == router_pb2.ENGINE_HEALTH_SERVING
    survivor = await engine_status(stack["survivor"].address)
    assert survivor.num_reserved_requests == 0


async def test_streams_end_promptly_with_unavailable_when_no_decode_engine_is_left(stack) -> None:
    router, survivor = stack["router"], stack["survivor"]
    stack["doomed"].kill()  # dead already when the test above ran
    async with create_channel(router.address, TransportSettings()) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        records = [Tracked(f"last{i}", []) for i in range(3)]
        # Long enough that none can finish before the last has started and the engine dies
        # (on a loaded machine the first may stream for seconds before the last starts).
        tasks = [asyncio.ensure_future(track(stub, _request(100 + i, p), r))
                 for i, (p, r) in enumerate(zip(PROMPTS, records, strict=False))]

        async def streaming() -> bool:
            return all(len(r.token_ids) > 0 for r in records)

        assert await wait_until(streaming, 60) is not None
        survivor.kill()
        killed_at = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    for record in records:
        assert record.error is not None, record
        assert record.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "Traceback" not in record.error.message
        assert record.ended_at_s - killed_at < 5.0
        assert 0 < len(record.token_ids) < MAX_TOKENS
