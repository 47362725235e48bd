"""Test helpers for the router: real shim subprocesses, an in-process router on port 0, a
Router.Generate client, and one engine's own answer (StartGenerate straight on a shim)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from microserving.stack.process import ServiceProcess
from microserving.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from router.router import Router
from router.server import RunningRouter, start_router
from router.settings import RouterSettings

REPO = Path(__file__).resolve().parents[2]


class Shim(ServiceProcess):
    """A shim process; its output is read (and dropped but for the last lines) so a full pipe
    never blocks it."""


def start_shims(roles: Sequence[str], extra_args: Sequence[str] = (), timeout_s: float = 120.0) -> list[Shim]:
    """Start one shim per role in parallel; returns once every one printed its address."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    shims = [
        Shim(f"shim-{i}-{role}",
             [sys.executable, "-m", "microserving.cli", "shim", "--backend", "embedded", "--model", "tiny",
              "--role", role, "--host", "127.0.0.1", "--port", "0", *extra_args],
             env=env, cwd=REPO)
        for i, role in enumerate(roles)
    ]
    deadline = time.monotonic() + timeout_s
    for shim in shims:
        shim.wait_listening(max(0.0, deadline - time.monotonic()))
    return shims


def kill_all(shims: Sequence[Shim]) -> None:
    for shim in shims:
        shim.kill(whole_group=True)


@contextlib.asynccontextmanager
async def running_router(router: Router) -> AsyncIterator[tuple[RunningRouter, router_pb2_grpc.RouterStub]]:
    running = await start_router(router, "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield running, router_pb2_grpc.RouterStub(channel)
    finally:
        await channel.close()
        await running.stop(grace_s=None)


def router_settings(engines: Sequence[str], **values: Any) -> RouterSettings:
    return RouterSettings.model_validate({"engines": list(engines), "model": "tiny", **values})


def greedy(max_tokens: int = 12, **extra: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


@dataclass
class Result:
    """Everything the router sent for one request."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: dict[int, int] = field(default_factory=dict)
    done: router_pb2.RequestDone | None = None
    error: router_pb2.RequestError | None = None
    num_deltas: int = 0
    prompt: router_pb2.PromptInfo | None = None


async def generate(
    stub: router_pb2_grpc.RouterStub, *requests: router_pb2.NewRequest, timeout_s: float = 120.0
) -> dict[str, Result]:
    """Send every request on one Generate stream and collect the answers."""

    async def messages() -> AsyncIterator[router_pb2.GenerateRequest]:
        for request in requests:
            yield router_pb2.GenerateRequest(generate=request)

    results: dict[str, Result] = {r.request_id: Result() for r in requests}
    call = stub.Generate(messages(), timeout=timeout_s)
    async for message in call:
        collect(results[message.request_id], message)
    return results


def collect(result: Result, message: router_pb2.GenerateResponse) -> None:
    kind = message.WhichOneof("event")
    if kind == "delta":
        result.token_ids.extend(message.delta.token_ids)
        result.text += message.delta.text
        result.num_deltas += 1
    elif kind == "finish":
        result.finish[message.finish.index] = message.finish.reason
    elif kind == "done":
        result.done = message.done
    elif kind == "error":
        result.error = message.error
    elif kind == "prompt":
        result.prompt = message.prompt


async def engine_alone(address: str, token_ids: Sequence[int], sampling: common_pb2.SamplingParams,
                       request_id: str) -> list[int]:
    """The tokens one engine produces on its own (StartGenerate from position 0)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        request = engine_pb2.StartGenerateRequest(request_id=request_id, token_ids=token_ids, begin=0, sampling=sampling)
        ids: list[int] = []
        async for message in stub.StartGenerate(request, timeout=120):
            for delta in message.choices:
                ids.extend(delta.token_ids)
        return ids


async def engine_status(address: str) -> engine_pb2.GetStatusResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await engine_pb2_grpc.EngineStub(channel).GetStatus(engine_pb2.GetStatusRequest(), timeout=10)


async def wait_for(predicate: Any, timeout_s: float = 15.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(interval_s)
    return False


_alone_ids = itertools.count()


async def disagg_matches_one_engine(shims: Sequence[Shim], tokens: list[int], **settings: Any) -> None:
    """One disagg request through a router over shims[0] (P) and shims[1] (D), made with
    `settings`, once both engines' statuses are known: its tokens are shims[2]'s alone, and
    both engines served it (P computed, D decoded)."""
    prefill, decode = shims[0].address, shims[1].address
    router = Router(settings=router_settings([f"{prefill}=prefill", f"{decode}=decode"], pattern="disagg",
                                             **settings))
    async with running_router(router) as (_, stub):
        async def statuses_known() -> bool:
            return all(e.status is not None for e in router.registry.endpoints)

        assert await wait_for(statuses_known)
        results = await generate(stub, router_pb2.NewRequest(
            request_id="r", token_ids=router_pb2.TokenIds(ids=tokens), sampling=greedy()))
    want = await engine_alone(shims[2].address, tokens, greedy(), f"alone-{next(_alone_ids)}")
    got = results["r"]
    assert got.error is None, got.error
    assert got.token_ids == want
    assert got.done is not None and len(got.done.engines) == 2
