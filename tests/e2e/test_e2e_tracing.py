"""One trace per request across every hop: a disagg stack (prefill and decode shims, router,
gateway) as processes on loopback, each exporting its OpenTelemetry spans to a JSON-lines
file (MICROSERVING_TRACE_FILE, the SDK's console exporter). A completion sent by the official
`openai` client with a W3C `traceparent` header yields spans in all four processes that share
its trace id and chain parent to child; the trace id is in the router's log lines; the
gateway returns the client's `x-request-id`."""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

pytest.importorskip("opentelemetry.sdk.trace", reason="needs the [otel] extra")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from stack_procs import (  # noqa: E402
    Service,
    start_gateway,
    start_router,
    start_shims,
    stop_all,
)

pytestmark = pytest.mark.e2e
SERVICES = ("gateway", "router", "shim-0-prefill", "shim-1-decode")


def read_spans(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    log_dir = tmp_path_factory.mktemp("traced-stack")

    def env(name: str) -> dict[str, str]:
        return {"MICROSERVING_TRACE_FILE": str(log_dir / f"{name}.spans.jsonl")}

    services: list[Service] = []
    try:
        shims = []
        for index, role in enumerate(("prefill", "decode")):
            name = f"shim-{index}-{role}"
            shims += start_shims(log_dir, [role], env=env(name), prefix=f"shim-{index}")
        services += shims
        prefill, decode = shims
        router = start_router(log_dir, [f"{prefill.address}=prefill", f"{decode.address}=decode"],
                              "--pattern", "disagg", "--log-level", "DEBUG", env=env("router"))
        services.append(router)
        gateway = start_gateway(log_dir, router.address, env=env("gateway"))
        services.append(gateway)
        trace_id = secrets.token_hex(16)
        client_span_id = secrets.token_hex(8)
        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", timeout=120)
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt="One trace, every hop.", max_tokens=4, temperature=0,
            extra_headers={"traceparent": f"00-{trace_id}-{client_span_id}-01",
                           "x-request-id": "client-request-42"})
        stop_all(services)  # every span is written as it ends; stop so the files are complete
        spans = {name: read_spans(log_dir / f"{name}.spans.jsonl") for name in SERVICES}
        yield {"trace_id": trace_id, "client_span_id": client_span_id, "spans": spans,
               "response": raw, "router_log": router.log()}
    finally:
        stop_all(services)


def _ours(spans: list[dict], trace_id: str) -> list[dict]:
    return [s for s in spans if s["context"]["trace_id"] == "0x" + trace_id]


def test_one_trace_spans_gateway_router_and_both_shims(traced: dict) -> None:
    trace_id = traced["trace_id"]
    names = {service: {s["name"] for s in _ours(spans, trace_id)}
             for service, spans in traced["spans"].items()}
    assert names["gateway"] == {"gateway /v1/completions"}
    assert {"router.request", "router.prep_recv", "router.remote_send"} <= names["router"]
    assert {"shim.prep_recv", "shim.generate"} <= names["shim-1-decode"]
    assert "shim.remote_send" in names["shim-0-prefill"]
    services = {s["resource"]["attributes"]["service.name"]
                for spans in traced["spans"].values() for s in _ours(spans, trace_id)}
    assert services == {"microserving-gateway", "microserving-router", "microserving-shim"}


def test_every_span_hangs_off_the_previous_hop(traced: dict) -> None:
    spans = [s for all_spans in traced["spans"].values() for s in _ours(all_spans, traced["trace_id"])]
    by_id = {s["context"]["span_id"]: s for s in spans}
    parent_name = {s["name"]: by_id[s["parent_id"]]["name"] for s in spans if s["parent_id"] in by_id}
    gateway = next(s for s in spans if s["name"].startswith("gateway"))
    assert gateway["parent_id"] == "0x" + traced["client_span_id"]  # the client's span
    assert parent_name["router.request"] == "gateway /v1/completions"
    assert parent_name["router.prep_recv"] == "router.request"
    assert parent_name["router.remote_send"] == "router.request"
    assert parent_name["shim.prep_recv"] == "router.prep_recv"
    assert parent_name["shim.remote_send"] == "router.remote_send"
    assert parent_name["shim.generate"] == "router.request"


def test_trace_id_and_request_id_reach_logs_and_response(traced: dict) -> None:
    assert traced["response"].headers["x-request-id"] == "client-request-42"
    log = traced["router_log"]
    mapping = [line for line in log.splitlines() if "engine request ids" in line]
    assert mapping and all(f"trace={traced['trace_id']}" in line for line in mapping), log[-2000:]
