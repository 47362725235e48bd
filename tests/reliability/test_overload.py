"""Overload: admission limits at the gateway (--max-inflight) and the router (--max-inflight).
Beyond them clients get 429 with Retry-After over HTTP and RESOURCE_EXHAUSTED over gRPC, never
a hang or a crash. 1,000 concurrent streaming clients against a two-engine tiny stack all
either finish their stream or get 429, and the peak memory (RSS) of every process is bounded
(measured with psutil, printed)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator

import aiohttp
import grpc
import pytest
from stack_procs import Service, greedy, start_gateway, start_router, start_shims, stop_all

from microserving.transport import TransportSettings, create_channel
from microserving.v1 import router_pb2, router_pb2_grpc

pytestmark = pytest.mark.e2e

NUM_CLIENTS = 1000
GATEWAY_LIMIT, ROUTER_LIMIT = 64, 24
MAX_RSS_GROWTH_BYTES = 400 * 1024 * 1024  # per process, over its idle RSS


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("overload")
    first, second = start_shims(logs, ["both", "both"])
    router = start_router(logs, [first.address, second.address], "--pattern", "round-robin",
                          "--max-inflight", str(ROUTER_LIMIT))
    gateway = start_gateway(logs, router.address, "--max-inflight", str(GATEWAY_LIMIT), "--log-level", "warning")
    services = {"shim-0": first, "shim-1": second, "router": router, "gateway": gateway}
    yield services
    stop_all(services.values())


class PeakRss:
    """Samples the RSS of each service every 20 ms in a thread; keeps the peak."""

    def __init__(self, services: dict[str, Service]) -> None:
        self._services = services
        self.idle = {name: s.rss_bytes() for name, s in services.items()}
        self.peak = dict(self.idle)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for name, service in self._services.items():
                self.peak[name] = max(self.peak[name], service.rss_bytes())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _client(session: aiohttp.ClientSession, url: str, i: int) -> tuple[int, str]:
    body = {"prompt": f"client {i}", "max_tokens": 3, "stream": True, "temperature": 0}
    async with session.post(url, json=body) as reply:
        if reply.status != 200:
            payload = await reply.json()
            assert payload["error"]["type"] == "rate_limit_error", payload
            assert reply.headers.get("Retry-After") == "1"
            return reply.status, ""
        events = [line.decode().strip() async for line in reply.content if line.startswith(b"data: ")]
    assert events[-1] == "data: [DONE]", events
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    return 200, "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


async def test_a_thousand_streaming_clients_finish_or_get_429_with_bounded_memory(stack) -> None:
    url = f"http://{stack['gateway'].address}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        started = time.monotonic()
        with PeakRss(stack) as rss:
            results = await asyncio.wait_for(
                asyncio.gather(*(_client(session, url, i) for i in range(NUM_CLIENTS))), timeout=150)
        elapsed_s = time.monotonic() - started
        statuses = Counter(status for status, _ in results)
        assert set(statuses) <= {200, 429}, statuses
        assert statuses[200] >= 1 and statuses[429] >= 1, statuses
        reply = await session.post(url, json={"prompt": "after", "max_tokens": 2})  # still serving
        assert reply.status == 200
    for name, service in stack.items():
        assert service.is_alive(), name
        assert rss.peak[name] - rss.idle[name] < MAX_RSS_GROWTH_BYTES, (name, rss.peak[name])
    mib = {name: round(peak / 2**20) for name, peak in rss.peak.items()}
    print(f"\noverload: {NUM_CLIENTS} streaming clients in {elapsed_s:.1f} s: {statuses[200]} finished, "
          f"{statuses[429]} got 429; peak RSS MiB {mib}")


async def test_router_over_its_limit_answers_resource_exhausted(stack) -> None:
    """ROUTER_LIMIT + 16 long requests on one stream: the router runs at most its limit and
    answers the rest RESOURCE_EXHAUSTED at once. Once every request has its answer (a first
    token or the refusal) the running ones are cancelled, rather than decoded to the end."""
    num_requests = ROUTER_LIMIT + 16
    outgoing: asyncio.Queue[router_pb2.GenerateRequest | None] = asyncio.Queue()
    for i in range(num_requests):
        outgoing.put_nowait(router_pb2.GenerateRequest(generate=router_pb2.NewRequest(
            # Long enough that the first ROUTER_LIMIT are still running when the last
            # arrive (24 tokens could finish first on fast engines).
            request_id=f"o{i}", text="over the limit", sampling=greedy(1000))))

    async def messages():  # type: ignore[no-untyped-def]
        while (item := await outgoing.get()) is not None:
            yield item

    outcome: dict[str, str] = {}
    ended: set[str] = set()
    cancelled = False
    async with create_channel(stack["router"].address, TransportSettings()) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        async for message in stub.Generate(messages(), timeout=120):
            request_id, event = message.request_id, message.WhichOneof("event")
            if event == "error":
                assert message.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message.error
                assert request_id not in outcome, request_id
                outcome[request_id] = "exhausted"
            elif event in ("delta", "done"):
                outcome.setdefault(request_id, "admitted")
            if event in ("error", "done"):
                ended.add(request_id)
            if not cancelled and len(outcome) == num_requests:
                cancelled = True
                for running in sorted(set(outcome) - ended):
                    outgoing.put_nowait(router_pb2.GenerateRequest(
                        cancel=router_pb2.CancelRequest(request_id=running)))
            if event in ("error", "done") and len(ended) == num_requests:
                outgoing.put_nowait(None)
    counts = Counter(outcome.values())
    assert len(outcome) == num_requests and ended == set(outcome), (counts, len(ended))
    # At most the limit ran at once: none of the admitted could finish 1,000 tokens before
    # the last request arrived, so exactly the limit was admitted.
    assert counts == {"admitted": ROUTER_LIMIT, "exhausted": num_requests - ROUTER_LIMIT}, counts
