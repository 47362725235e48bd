"""The OTLP exporter follows the standard OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL: http/protobuf
by default, grpc on request, and any other value is refused with a message."""

from __future__ import annotations

import pytest

from microserving import tracing

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs the [otel] extra")


@pytest.fixture(autouse=True)
def no_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")


def test_http_protobuf_is_the_default() -> None:
    exporter = tracing._otlp_exporter(tracing._otlp_protocol())
    assert type(exporter).__module__ == "opentelemetry.exporter.otlp.proto.http.trace_exporter"


def test_the_traces_variable_wins_and_grpc_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    exporter = tracing._otlp_exporter(tracing._otlp_protocol())
    assert type(exporter).__module__ == "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
    exporter.shutdown()


def test_an_unknown_protocol_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json.*not supported"):
        tracing._otlp_protocol()
