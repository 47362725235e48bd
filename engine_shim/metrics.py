"""The shim's Prometheus metrics: read from the backend's status snapshot when Prometheus
scrapes (a custom collector), so serving pays nothing for them: requests running, waiting
and reserved, KV pages, the prefix cache, and the engine's lifetime counters (steps and
their time, tokens sampled, preemptions). Names in docs/metrics.md."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from engine_shim.backend import Backend
from engine_shim.engine.api import EngineStatus

logger = logging.getLogger(__name__)

_PREFIX = "microserving_shim_"
# A scrape waits this long for the engine's status before reporting the engine down.
_STATUS_TIMEOUT_S = 5.0
Metric = GaugeMetricFamily | CounterMetricFamily | SummaryMetricFamily | InfoMetricFamily


class ShimMetrics:
    """One registry per shim; `bind(loop)` once the shim serves, so scrapes (on the metrics
    server's thread) can ask the backend for its status on the shim's event loop."""

    def __init__(self, backend: Backend, role: str) -> None:
        self.registry = CollectorRegistry()
        self._collector = _StatusCollector(backend, role)
        self.registry.register(self._collector)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._collector.loop = loop


class _StatusCollector(Collector):
    def __init__(self, backend: Backend, role: str) -> None:
        self._backend = backend
        self._role = role
        self.loop: asyncio.AbstractEventLoop | None = None

    def collect(self) -> Iterator[Metric]:
        status = self._read_status()
        up = GaugeMetricFamily(_PREFIX + "engine_up", "1 when the engine answered this scrape's status read.")
        up.add_metric([], 0.0 if status is None else 1.0)
        yield up
        if status is None:
            return
        info = self._backend.info
        yield InfoMetricFamily(_PREFIX + "engine", "The engine behind this shim.", value={
            "backend": info.name, "model": info.model_id, "device": info.device, "role": self._role})
        yield from _requests(status)
        tickets = self._backend.num_receive_tickets()
        if tickets is not None:
            yield _gauge("kv_receive_tickets", "Receive tickets open on the shim's KV plane: PrepRecv "
                         "reservations a push or write may fill, or filled and not yet taken by their start.",
                         tickets)
        sends = self._backend.kv_sends()
        if sends is not None:
            family = CounterMetricFamily(
                _PREFIX + "kv_sends", "RemoteSends this shim completed, by the path their KV took: "
                "nixl, shm-stream (the receiver's stage, on its PushKVStream), shm (the stage, a "
                "PushKV call each), grpc.", labels=["path"])
            for path, count in sorted(sends.items()):
                family.add_metric([path], count)
            yield family
        yield from _kv_pages(status)
        yield from _prefix_cache(status)
        yield from _counters(status)

    def _read_status(self) -> EngineStatus | None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return None
        future = asyncio.run_coroutine_threadsafe(self._backend.status(), loop)
        try:
            return future.result(timeout=_STATUS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - not started, shut down or stalled: report it down
            future.cancel()
            logger.debug("status read for metrics failed", exc_info=True)
            return None


def _gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(_PREFIX + name, help_, value=value)


def _counter(name: str, help_: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(_PREFIX + name, help_, value=value)


def _requests(status: EngineStatus) -> Iterator[Metric]:
    yield _gauge("running_requests", "Requests generating or prefilling.", status.num_running_requests)
    yield _gauge("waiting_requests", "Requests queued for admission.", status.num_waiting_requests)
    yield _gauge("reserved_requests", "PrepRecv reservations waiting for their StartGenerate.",
                 status.num_reserved_requests)


def _kv_pages(status: EngineStatus) -> Iterator[Metric]:
    if not status.num_total_pages:
        return  # the backend does not report its KV pool (MLC)
    yield _gauge("kv_total_pages", "KV pages of the pool.", status.num_total_pages)
    yield _gauge("kv_free_pages", "Free KV pages, evictable prefix-cache pages included.", status.num_free_pages)
    yield _gauge("kv_used_pages", "KV pages held by requests, reservations or referenced cache entries.",
                 status.num_total_pages - status.num_free_pages)
    yield _gauge("kv_usage_ratio", "Fraction of the KV pool in use (0..1).",
                 (status.num_total_pages - status.num_free_pages) / status.num_total_pages)
    if status.counters is not None:
        yield _gauge("kv_reserved_pages", "KV pages PrepRecv reservations hold.",
                     status.counters.num_reserved_pages)


def _prefix_cache(status: EngineStatus) -> Iterator[Metric]:
    cache = status.prefix_cache
    yield _counter("prefix_cache_queries", "Prompts looked up in the prefix cache.", cache.num_queries)
    yield _counter("prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.",
                   cache.num_query_tokens)
    yield _counter("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", cache.num_hit_tokens)
    yield _gauge("prefix_cache_hit_ratio", "Hit tokens / query tokens over the engine's life (0..1).",
                 cache.num_hit_tokens / cache.num_query_tokens if cache.num_query_tokens else 0.0)
    yield _gauge("prefix_cache_pages", "KV pages the prefix cache holds.", cache.num_cached_pages)
    yield _gauge("prefix_cache_evictable_pages", "Prefix-cache pages no request references.",
                 cache.num_evictable_pages)


def _counters(status: EngineStatus) -> Iterator[Metric]:
    counters = status.counters
    if counters is None:
        return
    step = SummaryMetricFamily(
        _PREFIX + "engine_step_seconds", "Wall time of engine steps (rate of sum / rate of count: mean step).",
        count_value=counters.num_steps, sum_value=counters.step_time_s)
    yield step
    yield _counter("generated_tokens", "Tokens sampled (rate(): tokens per second).", counters.num_sampled_tokens)
    yield _counter("preemptions", "Sequences preempted for lack of KV pages.", counters.num_preemptions)
    yield _counter("engine_busy_seconds", "Wall time the engine's loop worked: steps, calls, "
                   "outputs; its waits with no work left out (rate(): the busy share).",
                   counters.busy_time_s)
