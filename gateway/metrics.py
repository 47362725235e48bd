"""Prometheus metrics of one gateway: requests, errors, latency, tokens and in-flight work.

Each app owns its registry, so several gateways (tests) can live in one process. With several
worker processes (`--workers`, PROMETHEUS_MULTIPROC_DIR set by the CLI) every worker writes
its values to that directory and /metrics reports their sum.
"""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from microserving.metrics import LATENCY_BUCKETS_S

if TYPE_CHECKING:
    from gateway.errors import GatewayError



class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "microserving_gateway_requests", "HTTP requests by endpoint and status.",
            ["endpoint", "status"], registry=self.registry)
        self.errors = Counter(
            "microserving_gateway_errors", "Error responses by OpenAI error code.",
            ["code"], registry=self.registry)
        self.time_to_first_token_s = Histogram(
            "microserving_gateway_time_to_first_token_seconds",
            "Seconds from request arrival to the first generated text.",
            buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.inter_token_latency_s = Histogram(
            "microserving_gateway_inter_token_latency_seconds",
            "Seconds between consecutive deltas of one choice.",
            buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.finish_reasons = Counter(
            "microserving_gateway_finish_reasons", "Finished choices by OpenAI finish_reason.",
            ["reason"], registry=self.registry)
        self.prompt_tokens = Counter(
            "microserving_gateway_prompt_tokens", "Prompt tokens of finished requests.",
            registry=self.registry)
        self.completion_tokens = Counter(
            "microserving_gateway_completion_tokens", "Generated tokens of finished requests.",
            registry=self.registry)
        self._also: list[CollectorRegistry] = []  # e.g. an in-process router's (serve)
        self.inflight = Gauge(
            "microserving_gateway_inflight_requests", "Generation requests being served.",
            registry=self.registry, multiprocess_mode="livesum")

    def count_error(self, error: GatewayError) -> None:
        self.errors.labels(code=error.kind.code).inc()

    def also_render(self, registry: CollectorRegistry) -> None:
        """`registry` goes on /metrics too (the router of `microserving serve`, in this
        process). With worker processes its counters and histograms are summed with the
        rest; collectors that compute their values when scraped are left out there."""
        self._also.append(registry)

    def render(self) -> bytes:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # worker processes: all of them summed
            registry = CollectorRegistry()
            _WorkerFilesCollector(registry)
            return generate_latest(registry)
        return b"".join(generate_latest(r) for r in (self.registry, *self._also))


class _WorkerFilesCollector(MultiProcessCollector):
    """prometheus-client's multiprocess collector, less the files a worker is still creating.
    A worker opens each of its value files and only then sizes it (MmapedDict), so a scrape
    on another worker in between found an empty file and failed whole (struct.error, a 500 on
    /metrics) while a worker was starting or being replaced. Such a file holds no values yet:
    it is left out of this scrape."""

    def collect(self):  # type: ignore[no-untyped-def]  # as the base class's
        files = [f for f in glob.glob(os.path.join(self._path, "*.db")) if _has_header(f)]
        return self.merge(files, accumulate=True)


def _has_header(path: str) -> bool:
    try:
        return os.path.getsize(path) >= _HEADER_BYTES
    except FileNotFoundError:  # a live gauge's file, removed since the glob
        return False


_HEADER_BYTES = 8  # MmapedDict's used-bytes integer and its padding
