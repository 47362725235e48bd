"""The measurements of the control-plane benchmark: one closed-loop cell (a depth at a
concurrency), the echo round trip, and waiting for services to become healthy."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.loadgen.client import RequestOptions, RequestRecord
from bench.loadgen.runner import LoadShape, closed_loop, run_load
from bench.loadgen.stats import summarize
from bench.loadgen.workload import RequestSpec
from microserving.transport import TransportSettings, create_channel

# One request of a cell: (token ids, max_tokens, index, record, clock origin) -> filled record.
GrpcRequest = Callable[[list[int], int, int, RequestRecord, float], Awaitable[None]]


@dataclass(frozen=True)
class CellShape:
    """What each cell sends: prompts of prompt_len random byte tokens, output_len tokens."""

    prompt_len: int = 64
    output_len: int = 64
    requests_per_stream: int = 2
    min_requests: int = 16
    seed: int = 0

    def num_requests(self, concurrency: int) -> int:
        return max(self.min_requests, concurrency * self.requests_per_stream)

    def prompts(self, count: int, salt: int) -> list[list[int]]:
        """Distinct prompts (no prefix-cache hits between requests), ids in the byte range."""
        rng = random.Random(self.seed * 1_000_003 + salt)
        return [[rng.randrange(256) for _ in range(self.prompt_len)] for _ in range(count)]


async def grpc_cell(send: GrpcRequest, concurrency: int, shape: CellShape, salt: int) -> dict[str, Any]:
    """Warm up with a few requests, then run a closed loop at `concurrency`; the summary."""
    count = shape.num_requests(concurrency)
    warm = shape.prompts(min(concurrency, 4), salt + 7919)
    await _grpc_loop(send, warm, min(concurrency, 4), shape.output_len)
    records, duration_s = await _grpc_loop(send, shape.prompts(count, salt), concurrency,
                                           shape.output_len)
    return summarize(records, duration_s)


async def _grpc_loop(send: GrpcRequest, prompts: list[list[int]], concurrency: int,
                     output_len: int) -> tuple[list[RequestRecord], float]:
    origin_s = time.perf_counter()
    records = [RequestRecord(i, len(p), output_len) for i, p in enumerate(prompts)]

    async def one(i: int) -> None:
        await send(prompts[i], output_len, i, records[i], origin_s)

    await closed_loop(one, len(prompts), concurrency)
    return records, max(r.end_s for r in records)


async def http_cell(base_url: str, model: str, concurrency: int, shape: CellShape,
                    salt: int) -> dict[str, Any]:
    """The same cell through an OpenAI-compatible HTTP endpoint, with the load generator."""
    count = shape.num_requests(concurrency)
    specs = [RequestSpec(max_tokens=shape.output_len, input_len=shape.prompt_len, prompt=p)
             for p in shape.prompts(count, salt)]
    warm = [RequestSpec(shape.output_len, shape.prompt_len, prompt=p)
            for p in shape.prompts(min(concurrency, 4), salt + 7919)]
    options = RequestOptions(base_url=base_url, model=model, ignore_eos=True)
    outcome = await run_load(specs, options, LoadShape(concurrency=concurrency), warmup=warm,
                             show_progress=False)
    return summarize(outcome.records, outcome.duration_s)


async def wait_grpc_serving(address: str, timeout_s: float) -> None:
    """Poll grpc.health.v1 until the server's overall status is SERVING."""
    deadline = time.monotonic() + timeout_s
    async with create_channel(address, TransportSettings()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except Exception:  # not up yet; retried until the deadline
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f} s")
            await asyncio.sleep(0.3)


async def wait_http_ready(url: str, timeout_s: float) -> None:
    """Poll `url` until it answers 200."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(trust_env=False) as session:
        while True:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as reply:
                    if reply.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):  # not up yet (workers still starting)
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")
            await asyncio.sleep(0.3)
