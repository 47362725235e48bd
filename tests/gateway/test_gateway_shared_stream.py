"""The gateway multiplexes every HTTP request on one long-lived Router.GenerateBatched call: proven
against the real router (in process, its servicer counting Generate calls and the `cancel`
messages it reads) in front of two real embedded shims (prefill + decode, subprocesses)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_fixtures import RunningGateway, start_gateway

import router.server as router_server
from gateway.sse import parse_events
from microserving.v1 import router_pb2
from router.router import Router
from router.servicer import RouterServicer
from router.settings import RouterSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from stack_procs import (  # noqa: E402
    Service,
    engine_status,
    pages_at_baseline,
    router_status,
    start_shims,
    stop_all,
    wait_until,
)

pytestmark = pytest.mark.e2e
KEPT_TOKENS = 1000  # still generating when the other client hangs up, however slow its hang-up


@dataclass
class Recorder:
    """What the router's GenerateBatched servicer saw, across router restarts."""

    generate_calls: int = 0
    open_calls: int = 0
    max_open_calls: int = 0
    cancels: list[str] = field(default_factory=list)


class RealRouter:
    """The real router on 127.0.0.1 (port 0 the first time, the same port after a restart)."""

    def __init__(self, engines: list[str], recorder: Recorder) -> None:
        self.engines = engines
        self.recorder = recorder
        self.running: router_server.RunningRouter | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        settings = RouterSettings.model_validate(
            {"engines": self.engines, "model": "tiny", "pattern": "disagg"})
        self.running = await router_server.start_router(Router(settings=settings), "127.0.0.1",
                                                        self.port)
        self.port = self.running.port

    async def stop(self) -> None:
        if self.running is not None:
            running, self.running = self.running, None
            await running.stop(grace_s=None)


def counting_servicer(recorder: Recorder) -> type[RouterServicer]:
    class CountingServicer(RouterServicer):
        async def GenerateBatched(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
            recorder.generate_calls += 1
            recorder.open_calls += 1
            recorder.max_open_calls = max(recorder.max_open_calls, recorder.open_calls)

            async def recorded() -> AsyncIterator[router_pb2.GenerateRequest]:
                async for message in request_iterator:
                    if message.WhichOneof("action") == "cancel":
                        recorder.cancels.append(message.cancel.request_id)
                    yield message

            try:
                async for response in super().GenerateBatched(recorded(), context):
                    yield response
            finally:
                recorder.open_calls -= 1

    return CountingServicer


@pytest.fixture(scope="module")
def shims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Service]]:
    started = start_shims(tmp_path_factory.mktemp("shared-stream"), ["prefill", "decode"])
    yield started
    stop_all(started)


@pytest.fixture
async def stack(shims: list[Service], monkeypatch: pytest.MonkeyPatch
                ) -> AsyncIterator[tuple[RunningGateway, RealRouter]]:
    recorder = Recorder()
    monkeypatch.setattr(router_server, "RouterServicer", counting_servicer(recorder))
    real = RealRouter([f"{shims[0].address}=prefill", f"{shims[1].address}=decode"], recorder)
    await real.start()
    gateway = await start_gateway(real)
    try:
        yield gateway, real
    finally:
        await gateway.stop()
        await real.stop()


async def free_pages(shims: list[Service]) -> list[int]:
    return [(await engine_status(s.address)).num_free_kv_pages for s in shims]


def body(prompt: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": stream}


async def test_concurrent_requests_share_one_generate_call(
        stack: tuple[RunningGateway, RealRouter]) -> None:
    gateway, real = stack
    assert real.recorder.generate_calls == 0  # opened lazily, by the first request
    async with httpx.AsyncClient(base_url=gateway.api_url, timeout=60) as http:
        async def plain(i: int) -> httpx.Response:
            return await http.post("/completions", json=body(f"request number {i}", 24))

        async def streamed(i: int) -> list[Any]:
            reply = await http.post("/completions", json=body(f"streamed number {i}", 24, True))
            assert reply.status_code == 200
            return parse_events(reply.content)

        replies = await asyncio.gather(*(plain(i) for i in range(4)))
        streams = await asyncio.gather(*(streamed(i) for i in range(3)))
        later = await plain(99)
    for reply in [*replies, later]:
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 24
    for events in streams:
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
    assert real.recorder.generate_calls == 1
    assert real.recorder.cancels == []  # finished requests need no cancel


async def test_disconnect_cancels_only_its_request_and_frees_every_page(
        stack: tuple[RunningGateway, RealRouter], shims: list[Service]) -> None:
    gateway, real = stack
    baseline = await free_pages(shims)

    async def cancel_sent() -> None:
        while not real.recorder.cancels:
            await asyncio.sleep(0.01)

    kept_prompt = "the request that keeps going"
    async with httpx.AsyncClient(base_url=gateway.api_url, timeout=300) as http:
        async with http.stream("POST", "/completions", json=body(kept_prompt, KEPT_TOKENS, True)) as kept:
            assert kept.status_code == 200
            kept_lines = kept.aiter_lines()
            kept_text = ""
            while not kept_text:  # the kept request is running on the shared call
                line = await anext(kept_lines)
                if line.startswith("data: {"):
                    kept_text = line
            async with http.stream("POST", "/completions",
                                   json=body("the request that goes away", 400, True)) as dropped:
                assert dropped.status_code == 200
                events = 0
                async for line in dropped.aiter_lines():
                    events += line.startswith("data: ")
                    if events == 3:
                        break  # hang up mid-stream
            await asyncio.wait_for(cancel_sent(), 5)

            async def only_the_kept_request_runs() -> bool:
                return (await router_status(real.address)).num_inflight_requests == 1

            # The cancel reached the router while the kept request was still generating.
            assert await wait_until(only_the_kept_request_runs, 5, interval_s=0.01) is not None
            rest = [line async for line in kept_lines if line]
        alone = await http.post("/completions", json=body(kept_prompt, KEPT_TOKENS))
    assert alone.status_code == 200
    chunks = [json.loads(line[len("data: "):]) for line in [kept_text, *rest]
              if line.startswith("data: {")]
    assert rest[-1] == "data: [DONE]" and all("error" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # Every token of the kept request, exactly as when it runs alone (greedy).
    assert "".join(c["choices"][0]["text"] for c in chunks) == alone.json()["choices"][0]["text"]

    assert len(real.recorder.cancels) == 1 and real.recorder.cancels[0].startswith("cmpl-")
    seen = await pages_at_baseline([s.address for s in shims], baseline, within_s=2.0)
    assert seen == baseline
    assert real.recorder.generate_calls == 1  # the cancel did not end the shared call


async def test_a_broken_router_connection_fails_its_requests_and_the_next_opens_a_new_call(
        stack: tuple[RunningGateway, RealRouter]) -> None:
    gateway, real = stack
    async with httpx.AsyncClient(base_url=gateway.api_url, timeout=60) as http:
        assert (await http.post("/completions", json=body("warm up", 4))).status_code == 200
        async with http.stream("POST", "/completions",
                               json=body("cut off by the router", 400, True)) as cut:
            assert cut.status_code == 200
            lines = cut.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass
            await real.stop()  # the router goes away mid-stream: the shared call breaks
            tail = [line async for line in lines if line]
        events = parse_events(("\n\n".join(tail) + "\n\n").encode())
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "service_unavailable"
        assert real.recorder.generate_calls == 1

        await real.start()  # the same port
        async with httpx.AsyncClient(base_url=gateway.base_url) as probe:
            async with asyncio.timeout(15):
                while (await probe.get("/health")).status_code != 200:
                    await asyncio.sleep(0.05)
        reply = await http.post("/completions", json=body("after the restart", 8))
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8
    assert real.recorder.generate_calls == 2
