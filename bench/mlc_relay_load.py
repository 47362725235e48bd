"""The two sides of `microserving bench mlc-relay`, on the capacity bench's closed loop
(bench/capacity/client.py `drive`) so both count tokens and time first tokens the same way:

* direct: what an MLC user's HTTP client gets from mlc-compat engines. Round-robin streams
  /v1/completions from the one engine; disagg makes MLC's own router calls itself
  (prep_recv on the decode engine, remote_send on the prefill engine, start_generate).
* relay: the same workload as Router.GenerateBatched requests through gateway/router_client.py's
  RouterClient (the gateway's own shared-stream client) -> router -> `shim --backend mlc`;
  or, `--in-process-router`, through a router run in the benchmark's own process
  (router/inprocess.py, what `microserving serve` runs in the gateway's) -> the same shims.

And the raw round trips the added first-token time is counted in: a tiny HTTP GET to the engine
on a kept-alive connection, and a unary gRPC health check to the router on an open channel."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.capacity.client import (
    LoadResult,
    LoadSpec,
    StreamRecord,
    Window,
    drive,
    stream_completion,
)
from gateway.router_client import RouterClient, RouterLink
from microserving.transport import TransportSettings, create_channel
from microserving.v1 import common_pb2, router_pb2
from router.inprocess import InProcessRouter
from router.router import Router
from router.settings import RouterSettings

_ids = itertools.count()
_ROUND_TRIPS = 200  # samples per raw round trip (after 20 not counted)


def mlc_body(spec: LoadSpec) -> LoadSpec:
    """MLC asks for ignore_eos in debug_config."""
    return replace(spec, extra_body={"debug_config": {"ignore_eos": True}})


@dataclass(frozen=True)
class DisaggEngines:
    """Base URLs of the prefill and decode engines, and the decode engine's rank (the
    prefill engine's --peer for it)."""

    prefill_url: str
    decode_url: str
    decode_rank: int


def direct_load(disagg: DisaggEngines | None = None) -> Callable[..., Any]:
    """The direct HTTP client, round-robin (spec.base_url is the engine's /v1) or disagg."""

    async def load(spec: LoadSpec, at_edge: Callable[[str], None]) -> LoadResult:
        connector = aiohttp.TCPConnector(limit=0)  # prep/remote_send beside the open streams
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:

            async def send(ids: list[int], record: StreamRecord, window: Window, origin_s: float) -> None:
                try:
                    if disagg is None:
                        await stream_completion(session, spec, ids, window, origin_s, record)
                    else:
                        await _mlc_pd(session, spec, disagg, ids, window, origin_s, record)
                except (TimeoutError, aiohttp.ClientError, ValueError, KeyError) as error:
                    record.error = f"{type(error).__name__}: {error}"[:200]

            return await drive(spec, send, at_edge)

    return load


async def _mlc_pd(
    session: aiohttp.ClientSession, spec: LoadSpec, engines: DisaggEngines, ids: list[int],
    window: Window, origin_s: float, record: StreamRecord,
) -> None:
    """MLC's disaggregation flow, as its own router makes it (decode computes the last token)."""
    user = f"direct-{next(_ids)}"
    base = {"model": spec.model, "prompt": ids, "user": user, **spec.extra_body}
    end = len(ids) - 1
    async with session.post(f"{engines.decode_url}/microserving/prep_recv",
                            json={**base, "end": end}) as reply:
        reply.raise_for_status()
        prep = await reply.json()
    begin = int(prep["prefix_matched_length"])
    if begin < end:
        async with session.post(f"{engines.prefill_url}/microserving/remote_send", json={
            **base, "begin": begin, "end": end, "kv_addr_info": prep["kv_append_metadata"],
            "recv_rank": engines.decode_rank,
        }) as reply:
            reply.raise_for_status()
    await stream_completion(session, spec, ids, window, origin_s, record,
                            url=f"{engines.decode_url}/microserving/start_generate",
                            extra={"user": user, "begin": end})


def relay_load(router_address: str) -> Callable[..., Any]:
    """The router path, through the gateway's RouterClient (shared GenerateBatched calls)."""
    return _relay(lambda: RouterClient(router_address, TransportSettings()))


def in_process_relay_load(engines: list[str], pattern: str) -> Callable[..., Any]:
    """The router path with the router in this process (`microserving serve`'s topology): a
    Router over the same shims, started for each cell."""

    def router() -> RouterLink:
        settings = RouterSettings.model_validate(
            {"engines": engines, "pattern": pattern, "model": "tiny"})
        return InProcessRouter(Router(settings=settings))

    return _relay(router)


def _relay(make_client: Callable[[], RouterLink]) -> Callable[..., Any]:
    async def load(spec: LoadSpec, at_edge: Callable[[str], None]) -> LoadResult:
        client = make_client()
        await client.start()
        try:
            async def send(ids: list[int], record: StreamRecord, window: Window, origin_s: float) -> None:
                try:
                    await _via_router(client, spec, ids, window, origin_s, record)
                except aio.AioRpcError as error:
                    record.error = f"grpc_{error.code().name}: {error.details()}"[:200]

            return await drive(spec, send, at_edge)
        finally:
            await client.close()

    return load


async def _via_router(
    client: RouterLink, spec: LoadSpec, ids: list[int], window: Window, origin_s: float,
    record: StreamRecord,
) -> None:
    request = router_pb2.NewRequest(
        request_id=f"relay-{next(_ids)}", token_ids=router_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=spec.output_len,
                                           ignore_eos=True),
    )
    async with client.open_stream() as stream:
        await stream.start([request])
        async for batch in stream.batches():
            now_s = time.perf_counter() - origin_s
            for event in batch:
                _on_event(event, record, now_s, window)


def _on_event(event: router_pb2.GenerateResponse, record: StreamRecord, now_s: float,
              window: Window) -> None:
    kind = event.WhichOneof("event")
    if kind == "delta":
        num_tokens = len(event.delta.token_ids)
        if num_tokens:
            if record.ttft_s is None:
                record.ttft_s = now_s - record.started_s
            record.chunk_times_s.append(now_s)
            if now_s in window:
                record.num_tokens_in_window += num_tokens
    elif kind == "finish":
        record.finish_reason = common_pb2.FinishReason.Name(event.finish.reason)
    elif kind == "done":
        record.completion_tokens = event.done.usage.completion_tokens
    elif kind == "error":
        record.error = f"router error {event.error.code}: {event.error.message}"[:200]


@dataclass(frozen=True)
class RoundTrips:
    http_ms: float  # GET /v1/models on the engine, kept-alive connection: median
    http_spread_ms: tuple[float, float]  # p10, p90
    grpc_ms: float  # grpc.health.v1 Check on the router, open channel: median
    grpc_spread_ms: tuple[float, float]


async def round_trips(engine_url: str, router_address: str) -> RoundTrips:
    async with aiohttp.ClientSession(trust_env=False) as session:

        async def http_once() -> None:
            async with session.get(f"{engine_url}/v1/models") as reply:
                reply.raise_for_status()
                await reply.read()

        http = await _timed(http_once)
    async with create_channel(router_address, TransportSettings()) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        async def grpc_once() -> None:
            await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)

        grpc_s = await _timed(grpc_once)
    return RoundTrips(_ms(http, 50), (_ms(http, 10), _ms(http, 90)),
                      _ms(grpc_s, 50), (_ms(grpc_s, 10), _ms(grpc_s, 90)))


async def _timed(once: Callable[[], Any]) -> list[float]:
    samples = []
    for index in range(_ROUND_TRIPS + 20):
        started = time.perf_counter()
        await once()
        if index >= 20:
            samples.append(time.perf_counter() - started)
    return samples


def _ms(samples: list[float], q: int) -> float:
    return statistics.quantiles(samples, n=100)[q - 1] * 1e3 if q != 50 else \
        statistics.median(samples) * 1e3
