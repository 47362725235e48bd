"""The capacity benchmark's reading of the routers' histograms: a window's observations are
the difference of two scrapes, and its quantiles fall where Prometheus would put them."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from bench.capacity.router_metrics import cell_summary, parse
from microserving.metrics import LATENCY_BUCKETS_S


def _page(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_a_window_counts_only_its_own_observations_with_bucket_quantiles() -> None:
    registry = CollectorRegistry()
    calls = Histogram("microserving_router_engine_call_seconds", "calls", ["engine", "call"],
                      buckets=LATENCY_BUCKETS_S, registry=registry)
    ttft = Histogram("microserving_router_time_to_first_token_seconds", "ttft",
                     ["pattern", "engine"], buckets=LATENCY_BUCKETS_S, registry=registry)
    for _ in range(30):  # before the window: must not count
        calls.labels("a:1", "remote_send").observe(0.2)
    opened = parse(_page(registry))
    for engine in ("a:1", "b:2"):  # two engines, summed
        for _ in range(25):
            calls.labels(engine, "remote_send").observe(0.0002)  # bucket (0.1 ms, 0.25 ms]
            calls.labels(engine, "remote_send").observe(0.003)  # bucket (2.5 ms, 5 ms]
    calls.labels("a:1", "prep_recv").observe(0.0007)
    ttft.labels("disagg", "b:2").observe(0.04)
    summary = cell_summary(opened, parse(_page(registry)))
    send = summary["engine_calls"]["remote_send"]
    assert send["count"] == 100
    assert send["mean_ms"] == pytest.approx(1.6)
    assert send["p50_ms"] == pytest.approx(0.25)  # the 50th of 100 ends the lower bucket
    assert send["p99_ms"] == pytest.approx(2.5 + 2.5 * 49 / 50)  # linear inside (2.5, 5]
    assert summary["engine_calls"]["prep_recv"]["count"] == 1
    assert summary["router_ttft"]["count"] == 1
    assert 25 < summary["router_ttft"]["p50_ms"] <= 50  # inside the (25 ms, 50 ms] bucket
