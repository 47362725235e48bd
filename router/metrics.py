"""The router's Prometheus metrics (one registry per Router): per request its outcome,
end-to-end latency, time to first token and mean inter-token latency, by pattern and the
engine that decoded; per engine the PrepRecv / RemoteSend latencies and KV moved, retries,
resumes, preemptions and times it left rotation; read at scrape time, each engine's health
state and in-flight calls by stage. Everything is observed once per request or per engine
call, never per token (docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from microserving.metrics import LATENCY_BUCKETS_S, THROUGHPUT_BUCKETS_BYTES_PER_S
from microserving.v1 import router_pb2
from router.endpoint import (
    STAGE_DECODE,
    STAGE_PREP_RECV,
    STAGE_REMOTE_SEND,
    STAGE_RESERVED,
    Endpoint,
)

HEALTH_STATES = {
    router_pb2.ENGINE_HEALTH_UNSPECIFIED: "unknown",
    router_pb2.ENGINE_HEALTH_SERVING: "serving",
    router_pb2.ENGINE_HEALTH_NOT_SERVING: "not_serving",
    router_pb2.ENGINE_HEALTH_UNREACHABLE: "unreachable",
}
_PREFIX = "microserving_router_"
STAGES = (STAGE_PREP_RECV, STAGE_RESERVED, STAGE_REMOTE_SEND, STAGE_DECODE)


class RouterMetrics:
    def __init__(self, endpoints: Callable[[], Iterable[Endpoint]]) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            _PREFIX + "requests", "Requests ended, by pattern and outcome (done, cancelled, error).",
            ["pattern", "outcome"], registry=reg)
        self.e2e_latency_s = Histogram(
            _PREFIX + "e2e_request_latency_seconds",
            "Seconds from a request's arrival at the router to its end.",
            ["pattern"], buckets=LATENCY_BUCKETS_S, registry=reg)
        self.time_to_first_token_s = Histogram(
            _PREFIX + "time_to_first_token_seconds",
            "Seconds from arrival to the first engine output, by pattern and decode engine.",
            ["pattern", "engine"], buckets=LATENCY_BUCKETS_S, registry=reg)
        self.inter_token_latency_s = Histogram(
            _PREFIX + "inter_token_latency_seconds",
            "Mean seconds per generated token after the first, one observation per request.",
            ["pattern", "engine"], buckets=LATENCY_BUCKETS_S, registry=reg)
        self.engine_call_s = Histogram(
            _PREFIX + "engine_call_seconds",
            "Seconds of a successful PrepRecv or RemoteSend, by engine and call.",
            ["engine", "call"], buckets=LATENCY_BUCKETS_S, registry=reg)
        self.engine_call_failures = Counter(
            _PREFIX + "engine_call_failures", "Engine calls that failed, by engine, call and gRPC code.",
            ["engine", "call", "code"], registry=reg)
        self.kv_transfer_bytes = Counter(
            _PREFIX + "kv_transfer_bytes",
            "KV bytes RemoteSend moved from this engine (tokens x the engine's KV bytes per token).",
            ["engine"], registry=reg)
        self.kv_transfer_tokens = Counter(
            _PREFIX + "kv_transfer_tokens", "Prompt tokens whose KV RemoteSend moved from this engine.",
            ["engine"], registry=reg)
        self.kv_transfer_rate = Histogram(
            _PREFIX + "kv_transfer_bytes_per_second",
            "KV bytes per second of one RemoteSend (divide by 1e9 for GB/s).",
            ["engine"], buckets=THROUGHPUT_BUCKETS_BYTES_PER_S, registry=reg)
        self.first_tokens_from_prefill = Counter(
            _PREFIX + "first_tokens_from_prefill",
            "Disaggregated requests whose first token the prefill engine sampled (first_token_on_prefill), "
            "by prefill engine.", ["engine"], registry=reg)
        self.retries = Counter(
            _PREFIX + "retries", "Attempts run again elsewhere before any token was streamed, by failed engine.",
            ["engine"], registry=reg)
        self.resumes = Counter(
            _PREFIX + "resumes", "Attempts continued elsewhere after tokens were streamed, by failed engine.",
            ["engine"], registry=reg)
        self.preemptions = Counter(
            _PREFIX + "preemptions", "Attempts an engine preempted (the request ran the pattern again).",
            registry=reg)
        self.failovers = Counter(
            _PREFIX + "engine_failovers", "Times an engine left rotation (failed check, call or stall).",
            ["engine"], registry=reg)
        self.inflight = Gauge(
            _PREFIX + "inflight_requests", "Requests the router is serving.", registry=reg)
        self.queued = Gauge(
            _PREFIX + "queued_requests", "Requests waiting for KV room on a full engine.", registry=reg)
        reg.register(_EngineCollector(endpoints))


class _EngineCollector(Collector):
    """Per engine, at scrape time: the health state and the router's in-flight calls by stage."""

    def __init__(self, endpoints: Callable[[], Iterable[Endpoint]]) -> None:
        self._endpoints = endpoints

    def collect(self) -> Iterator[GaugeMetricFamily]:
        health = GaugeMetricFamily(
            _PREFIX + "engine_health_state", "1 for the engine's current health state, else 0.",
            labels=["engine", "state"])
        inflight = GaugeMetricFamily(
            _PREFIX + "engine_inflight_requests",
            "Router calls in flight on the engine, by stage (prep_recv, reserved, remote_send, decode).",
            labels=["engine", "stage"])
        load = GaugeMetricFamily(
            _PREFIX + "engine_load", "The engine's load as placement sees it (own in-flight + reported).",
            labels=["engine"])
        for endpoint in list(self._endpoints()):  # a copy: the event loop mutates the registry
            for value, state in HEALTH_STATES.items():
                health.add_metric([endpoint.address, state], 1.0 if endpoint.health == value else 0.0)
            for stage in STAGES:
                inflight.add_metric([endpoint.address, stage], float(endpoint.inflight.get(stage, 0)))
            load.add_metric([endpoint.address], endpoint.load)
        yield health
        yield inflight
        yield load
