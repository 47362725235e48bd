"""What the routers and the gateway saw during a cell, from their Prometheus /metrics at the
window's edges: how long the engine calls of a disaggregated request took (PrepRecv,
RemoteSend: the KV push is inside RemoteSend), and the time to first token measured at the
router and at the gateway, which split the client's first-token time into the hops below the
router, the gateway's own, and the client's (its HTTP request and its own turnaround).

Quantiles come from the histograms' bucket counts (linear inside a bucket, as Prometheus's
histogram_quantile), so they are as fine as the buckets (microserving.metrics)."""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

_CALLS = "microserving_router_engine_call_seconds"
_TTFT = "microserving_router_time_to_first_token_seconds"
_GATEWAY_TTFT = "microserving_gateway_time_to_first_token_seconds"
_SUMMARY_KEYS = {_TTFT: "router_ttft", _GATEWAY_TTFT: "gateway_ttft"}
_SCRAPE_TIMEOUT_S = 5.0


@dataclass
class Histogram:
    """One histogram, summed over the label sets and routers it was read from."""

    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative count
    total_s: float = 0.0
    count: float = 0.0

    def add(self, other: Histogram, sign: float = 1.0) -> None:
        for bound, n in other.buckets.items():
            self.buckets[bound] = self.buckets.get(bound, 0.0) + sign * n
        self.total_s += sign * other.total_s
        self.count += sign * other.count

    def quantile(self, q: float) -> float | None:
        """Seconds below which a fraction `q` of the observations fall (None: no observation)."""
        if self.count <= 0:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for bound in sorted(self.buckets):
            cumulative = self.buckets[bound]
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower  # past the last finite bound: its value is all we know
                inside = cumulative - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = bound, cumulative
        return lower

    def summary(self) -> dict[str, Any]:
        p50, p99 = self.quantile(0.5), self.quantile(0.99)
        return {
            "count": int(round(self.count)),
            "mean_ms": self.total_s / self.count * 1e3 if self.count > 0 else None,
            "p50_ms": None if p50 is None else p50 * 1e3,
            "p99_ms": None if p99 is None else p99 * 1e3,
        }


# Histogram name and the label it is kept apart by ("" for one histogram) -> its histogram.
Snapshot = dict[tuple[str, str], Histogram]


def fetch(port: int) -> str:
    """One local process's /metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=_SCRAPE_TIMEOUT_S) as reply:
        return str(reply.read().decode())


def scrape(ports: list[int]) -> Snapshot:
    """The engine-call and first-token histograms of every page, summed over the routers (a
    port listed twice, as the gateway's of `microserving serve`, read once)."""
    found: Snapshot = {}
    for port in dict.fromkeys(ports):
        parse(fetch(port), found)
    return found


def parse(text: str, into: Snapshot | None = None) -> Snapshot:
    """The engine-call and first-token histograms of one /metrics page (added to `into`)."""
    found: Snapshot = {} if into is None else into
    for family in text_string_to_metric_families(text):
        if family.name not in (_CALLS, _TTFT, _GATEWAY_TTFT):
            continue
        for sample in family.samples:
            histogram = found.setdefault((family.name, sample.labels.get("call", "")), Histogram())
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                histogram.buckets[bound] = histogram.buckets.get(bound, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                histogram.total_s += sample.value
            elif sample.name.endswith("_count"):
                histogram.count += sample.value
    return found


def cell_summary(opened: Snapshot, closed: Snapshot) -> dict[str, Any]:
    """Per engine call, and the router's and the gateway's first-token times, over the
    window: count, mean, p50 and p99 in ms."""
    calls: dict[str, Any] = {}
    ttfts: dict[str, dict[str, Any] | None] = dict.fromkeys(_SUMMARY_KEYS.values())
    for key, after in closed.items():
        window = Histogram()
        window.add(after)
        if key in opened:
            window.add(opened[key], sign=-1.0)
        if key[0] in _SUMMARY_KEYS:
            ttfts[_SUMMARY_KEYS[key[0]]] = window.summary()
        elif window.count > 0:
            calls[key[1]] = window.summary()
    return {"engine_calls": calls, **ttfts}
