"""The request loop: closed loop (a fixed number of requests in flight) or open loop (Poisson
arrivals at a seeded rate), after a warm-up whose requests are not counted."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from bench.loadgen.client import RequestOptions, RequestRecord, send_request
from bench.loadgen.workload import RequestSpec

OneRequest = Callable[[int], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class LoadShape:
    """Exactly one of concurrency (closed loop) and request_rate (open loop, req/s; inf sends
    everything at once). max_concurrency caps the open loop's in-flight requests."""

    concurrency: int | None = None
    request_rate: float | None = None
    seed: int = 0
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("give exactly one of concurrency and request_rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError("request_rate must be > 0")

    @property
    def is_closed_loop(self) -> bool:
        return self.concurrency is not None

    @property
    def connection_limit(self) -> int:
        return self.concurrency or self.max_concurrency or 0  # 0: unlimited in aiohttp


@dataclass
class RunOutcome:
    """Records of the measured requests, with the measured phase's wall time."""

    records: list[RequestRecord]
    duration_s: float
    max_in_flight: int


class _InFlight:
    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def enter(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        self.now -= 1


async def run_load(
    specs: Sequence[RequestSpec],
    options: RequestOptions,
    shape: LoadShape,
    *,
    warmup: Sequence[RequestSpec] = (),
    show_progress: bool = True,
) -> RunOutcome:
    """Send the warm-up requests, then `specs` in the given shape; return their records."""
    connector = aiohttp.TCPConnector(limit=shape.connection_limit, force_close=False)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        if warmup:
            warm_shape = LoadShape(concurrency=min(len(warmup), shape.concurrency or 4))
            await _run(session, warmup, options, warm_shape, None)
        bar = tqdm(total=len(specs), desc="requests", unit="req", disable=not show_progress)
        try:
            return await _run(session, specs, options, shape, bar)
        finally:
            bar.close()


async def _run(
    session: aiohttp.ClientSession,
    specs: Sequence[RequestSpec],
    options: RequestOptions,
    shape: LoadShape,
    bar: tqdm | None,
) -> RunOutcome:
    origin_s = time.perf_counter()
    records = [RequestRecord(i, s.input_len, s.max_tokens) for i, s in enumerate(specs)]
    in_flight = _InFlight()
    limiter = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None

    async def one(i: int) -> None:
        if limiter is not None:
            await limiter.acquire()
        in_flight.enter()
        try:
            await send_request(session, specs[i], options, records[i], origin_s)
        finally:
            in_flight.leave()
            if limiter is not None:
                limiter.release()
            if bar is not None:
                bar.update(1)

    if shape.is_closed_loop:
        await closed_loop(one, len(specs), shape.concurrency or 1)
    else:
        await _open_loop(one, len(specs), shape)
    duration_s = max((r.end_s for r in records), default=0.0)
    return RunOutcome(records, duration_s, in_flight.peak)


async def closed_loop(one: OneRequest, num_requests: int, concurrency: int) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            await one(queue.get_nowait())

    await asyncio.gather(*(worker() for _ in range(min(concurrency, num_requests))))


def arrival_times_s(num_requests: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: exponential gaps of mean 1/rate from a seeded generator."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def _open_loop(one: OneRequest, num_requests: int, shape: LoadShape) -> None:
    start_s = time.perf_counter()
    tasks: list[asyncio.Task[None]] = []
    for i, at_s in enumerate(arrival_times_s(num_requests, shape.request_rate or 1.0, shape.seed)):
        delay_s = at_s - (time.perf_counter() - start_s)
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
