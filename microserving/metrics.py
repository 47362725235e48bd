"""What every service's Prometheus metrics share: the latency buckets (one scale from a
100 us CPU relay hop to a two-minute GPU generation) and the HTTP endpoint of the gRPC
services (their gRPC port cannot answer a scrape, so /metrics gets a port of its own)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

# Seconds. Dense at the low end (router and gateway hops take tens to hundreds of
# microseconds, a GPU decode step a few milliseconds), sparse up to whole generations.
LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)
# Bytes per second of a KV transfer: from a loopback gRPC stream on a CPU (tens of MB/s) to
# NVLink (hundreds of GB/s).
THROUGHPUT_BUCKETS_BYTES_PER_S = (
    1e6, 1e7, 5e7, 1e8, 5e8, 1e9, 5e9, 1e10, 5e10, 1e11, 5e11,
)


@dataclass
class MetricsServer:
    """A running /metrics endpoint (prometheus-client's threaded HTTP server)."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve `registry` on http://host:port/metrics (port 0 picks a free one) in a thread of
    its own; scrapes never run on the service's event loop."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)
