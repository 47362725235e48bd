"""Real service processes for the reliability and security tests: shims, a router and a
gateway started through `python -m microserving.cli ...` on port 0, each logging to a file
of its own (the tests read the logs, e.g. to check that no secret was written), plus small
gRPC / HTTP helpers. Processes can be killed (SIGKILL), paused (SIGSTOP) and resumed."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from microserving.stack.process import ServiceProcess, free_port
from microserving.transport import TransportSettings, create_channel
from microserving.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

__all__ = ["free_port"]  # re-exported for the tests that pick a port before starting

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment without MICROSERVING_* settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MICROSERVING_")}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


class Service(ServiceProcess):
    """A service of a test stack, logging to a file of its own."""

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.output()

    def rss_bytes(self) -> int:
        try:
            return int(psutil.Process(self.pid).memory_info().rss)
        except psutil.Error:
            return 0


def launch(name: str, args: Sequence[str], log_dir: Path, env: dict[str, str] | None = None) -> Service:
    """Start `microserving <args>`; call wait_listening() before using it."""
    return Service(name, [sys.executable, "-m", "microserving.cli", *args],
                   log_path=log_dir / f"{name}.log", env=clean_env(env), cwd=REPO)


def wait_listening(services: Iterable[Service], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Wait until every service printed `listening on HOST:PORT` (they start side by side)."""
    deadline = time.monotonic() + timeout_s
    for service in services:
        service.wait_listening(max(0.0, deadline - time.monotonic()))


def start_shims(log_dir: Path, roles: Sequence[str], *extra: str, env: dict[str, str] | None = None,
                prefix: str = "shim") -> list[Service]:
    shims = [
        launch(f"{prefix}-{i}-{role}", ["shim", "--backend", "embedded", "--model", "tiny",
                                        "--role", role, "--port", "0", *extra], log_dir, env)
        for i, role in enumerate(roles)
    ]
    wait_listening(shims)
    return shims


def start_router(log_dir: Path, engines: Sequence[str], *extra: str, port: int = 0,
                 env: dict[str, str] | None = None, name: str = "router") -> Service:
    args = ["router", "--model", "tiny", "--port", str(port)]
    for engine in engines:
        args += ["--engine", engine]
    router = launch(name, [*args, *extra], log_dir, env)
    wait_listening([router])
    return router


def start_gateway(log_dir: Path, router_address: str, *extra: str,
                  env: dict[str, str] | None = None, name: str = "gateway") -> Service:
    gateway = launch(name, ["gateway", "--router", router_address, "--port", "0", *extra], log_dir, env)
    wait_listening([gateway])
    return gateway


def stop_all(services: Iterable[Service]) -> None:
    for service in services:
        service.kill(whole_group=True)


# ---- gRPC helpers ----

def greedy(max_tokens: int = 16, **extra: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


async def engine_status(address: str, transport: TransportSettings | None = None) -> engine_pb2.GetStatusResponse:
    async with create_channel(address, transport or TransportSettings()) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        return await stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=5)


async def router_status(address: str, transport: TransportSettings | None = None) -> router_pb2.RouterGetStatusResponse:
    async with create_channel(address, transport or TransportSettings()) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return await stub.GetStatus(router_pb2.RouterGetStatusRequest(), timeout=5)


async def engine_health(router_address: str) -> dict[str, int]:
    """Engine address -> router_pb2.EngineHealth as the router reports it."""
    status = await router_status(router_address)
    return {engine.address: engine.health for engine in status.engines}


def until(condition: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Whether `condition()` held within `timeout_s` (polled every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def worker_pids(pid: int) -> list[int]:
    """The worker processes a gateway (or anything else) started with multiprocessing's spawn,
    not its resource tracker (Linux: /proc)."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    workers = []
    for child in (int(p) for p in text.split()):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                workers.append(child)
        except OSError:
            continue  # gone meanwhile
    return workers


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 20.0,
                     interval_s: float = 0.05) -> float | None:
    """Seconds until `predicate()` held, or None if it never did within `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if await predicate():
            return time.monotonic() - started
        await asyncio.sleep(interval_s)
    return None


async def pages_at_baseline(addresses: Sequence[str], baseline: Sequence[int], within_s: float = 1.0) -> list[int]:
    """Free pages of each engine once all equal `baseline` (or the last values after within_s)."""
    seen: list[int] = []

    async def at_baseline() -> bool:
        nonlocal seen
        seen = [(await engine_status(a)).num_free_kv_pages for a in addresses]
        return seen == list(baseline)

    await wait_until(at_baseline, timeout_s=within_s, interval_s=0.02)
    return seen


async def hang_up_mid_stream(gateway_address: str, prompt: str, after_events: int = 3,
                             max_tokens: int = 400) -> None:
    """A streamed /v1/completions through the gateway at `gateway_address`, its connection
    closed after `after_events` SSE events (the request still generating)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with (httpx.AsyncClient(base_url=f"http://{gateway_address}", timeout=60) as client,
                client.stream("POST", "/v1/completions", json=body) as response):
        assert response.status_code == 200
        events = 0
        async for line in response.aiter_lines():
            events += line.startswith("data: ")
            if events == after_events:
                return  # hang up mid-stream


@dataclass
class Tracked:
    """One request sent on a Router.Generate stream of its own, recorded as it streams."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    error: router_pb2.RequestError | None = None
    rpc_error: str = ""
    done: router_pb2.RequestDone | None = None
    ended_at_s: float = 0.0


async def track(stub: router_pb2_grpc.RouterStub, request: router_pb2.NewRequest,
                record: Tracked, timeout_s: float = 120.0) -> Tracked:
    """Send `request` and fill `record` until its done / error (or the call fails)."""

    async def messages():  # type: ignore[no-untyped-def]
        yield router_pb2.GenerateRequest(generate=request)

    try:
        async for message in stub.Generate(messages(), timeout=timeout_s):
            kind = message.WhichOneof("event")
            if kind == "delta":
                record.token_ids.extend(message.delta.token_ids)
                record.text += message.delta.text
            elif kind == "done":
                record.done = message.done
            elif kind == "error":
                record.error = message.error
    except Exception as exc:  # noqa: BLE001 - recorded; the test asserts on it
        record.rpc_error = repr(exc)
    record.ended_at_s = time.monotonic()
    return record
