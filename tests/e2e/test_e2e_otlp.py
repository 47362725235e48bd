"""Spans leave the processes over OTLP, configured only by the standard variables: a shim, a
router and a gateway as processes with OTEL_EXPORTER_OTLP_ENDPOINT pointing at a small OTLP/HTTP
receiver in this test (the stdlib's HTTP server); a completion sent by the official `openai`
client with a `traceparent` reaches it as protobuf ExportTraceServiceRequests (parsed with
opentelemetry-proto) that carry spans of that trace from all three services."""

from __future__ import annotations

import gzip
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs the [otel] extra")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from stack_procs import Service, start_gateway, start_router, start_shims, stop_all  # noqa: E402

pytestmark = pytest.mark.e2e
ARRIVAL_TIMEOUT_S = 60.0  # the batch processor exports every OTEL_BSP_SCHEDULE_DELAY below


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: keeps every decoded request, answers 200."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), ReceiverHandler)
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()

    def spans(self) -> list[tuple[str, str, bytes]]:
        """(service.name, span name, trace id) of every span received so far."""
        with self.lock:
            requests = list(self.requests)
        found = []
        for request in requests:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    found += [(attributes["service.name"], s.name, s.trace_id) for s in scope.spans]
        return found


class ReceiverHandler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            self.server.requests.append(request)
            self.server.paths.append(self.path)
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
        pass


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_spans_of_every_service_reach_an_otlp_http_receiver(receiver: Receiver, tmp_path: Path) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_address[1]}",
           "OTEL_BSP_SCHEDULE_DELAY": "200"}  # export within 0.2 s, not the default 5 s
    services: list[Service] = []
    try:
        services += start_shims(tmp_path, ["both"], env=env)
        services.append(start_router(tmp_path, [services[0].address], env=env))
        gateway = start_gateway(tmp_path, services[1].address, env=env)
        services.append(gateway)
        trace_id = secrets.token_hex(16)
        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", timeout=120)
        client.completions.create(model="tiny", prompt="Spans over OTLP.", max_tokens=4, temperature=0,
                                  extra_headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
        wanted = {"microserving-gateway", "microserving-router", "microserving-shim"}
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        while True:
            ours = [(service, name) for service, name, tid in receiver.spans()
                    if tid == bytes.fromhex(trace_id)]
            if {service for service, _ in ours} >= wanted or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        stop_all(reversed(services))
    assert {service for service, _ in ours} == wanted, (ours, [s.log()[-1500:] for s in services])
    assert ("microserving-gateway", "gateway /v1/completions") in ours
    assert ("microserving-router", "router.request") in ours
    assert ("microserving-shim", "shim.generate") in ours
    assert set(receiver.paths) == {"/v1/traces"}  # the exporter's standard path under the endpoint
