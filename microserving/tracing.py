"""W3C trace context through every hop, and OpenTelemetry spans when asked for.

A request's `traceparent` (from the HTTP header, or made up by the gateway) travels gateway →
router in NewRequest.traceparent, router → shim as the `traceparent` gRPC metadata key of
unary calls and StartGenerateRequest.traceparent on the multiplexed Generate stream. Each hop
puts the trace id into its log records (`TraceIdFilter`).

Spans are off unless `configure` finds an exporter asked for and the SDK installed (the
`[otel]` extra): OTEL_TRACES_EXPORTER=otlp|console, an OTEL_EXPORTER_OTLP_*ENDPOINT, or
MICROSERVING_TRACE_FILE (spans as JSON lines, for tests and debugging). Off, a hop costs a
context-variable set and a string copy: the incoming traceparent passes through as it is, so
log lines still share the trace id. On, each hop opens a span as a child of the incoming
context and sends its own span's traceparent on.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

TRACEPARENT_KEY = "traceparent"
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")
_trace_id: contextvars.ContextVar[str] = contextvars.ContextVar("microserving_trace_id", default="-")
_tracer: Any = None  # an SDK Tracer once configure() enabled spans

logger = logging.getLogger(__name__)


def new_traceparent() -> str:
    """A fresh, sampled W3C traceparent (version 00)."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def valid_traceparent(value: str | None) -> str:
    """`value` when it is a well-formed traceparent with a non-zero trace id, else ''."""
    if not value:
        return ""
    match = _TRACEPARENT.match(value.strip().lower())
    if match is None or match.group(1) == "0" * 32:
        return ""
    return value.strip().lower()


def trace_id_of(traceparent: str) -> str:
    match = _TRACEPARENT.match(traceparent)
    return match.group(1) if match else "-"


def current_trace_id() -> str:
    return _trace_id.get()


def is_enabled() -> bool:
    return _tracer is not None


def metadata(traceparent: str) -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata carrying `traceparent` (None when there is none)."""
    return ((TRACEPARENT_KEY, traceparent),) if traceparent else None


def from_metadata(pairs: Sequence[tuple[str, Any]] | None) -> str:
    for key, value in pairs or ():
        if key == TRACEPARENT_KEY and isinstance(value, str):
            return valid_traceparent(value)
    return ""


class Span:
    """One hop of a request: a span when tracing is on, else a pass-through. Use as a context
    manager, or `start()` / `end()` when the hop outlives a block (a streamed response).
    `traceparent` is what this hop sends on."""

    __slots__ = ("_attributes", "_name", "_otel_span", "_token", "traceparent")

    def __init__(self, name: str, parent: str, attributes: Mapping[str, Any] | None = None) -> None:
        self._name = name
        self._attributes = attributes
        self.traceparent = parent
        self._otel_span: Any = None
        self._token: contextvars.Token[str] | None = None

    def start(self) -> Span:
        if _tracer is not None:
            self._otel_span, self.traceparent = _start_otel_span(self._name, self.traceparent, self._attributes)
        self._token = _trace_id.set(trace_id_of(self.traceparent))
        return self

    def set_attribute(self, key: str, value: Any) -> None:
        if self._otel_span is not None:
            self._otel_span.set_attribute(key, value)

    def end(self, error: BaseException | None = None) -> None:
        span, self._otel_span = self._otel_span, None
        if span is not None:
            if error is not None and not isinstance(error, GeneratorExit):
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            span.end()
        token, self._token = self._token, None
        if token is not None:
            # ValueError: ended from another context (e.g. a stream closed elsewhere)
            with contextlib.suppress(ValueError):
                _trace_id.reset(token)

    def __enter__(self) -> Span:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.end(error)


def _start_otel_span(name: str, parent: str, attributes: Mapping[str, Any] | None) -> tuple[Any, str]:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()
    context = propagator.extract({TRACEPARENT_KEY: parent}) if parent else None
    span = _tracer.start_span(name, context=context, attributes=dict(attributes or {}))
    carrier: dict[str, str] = {}
    propagator.inject(carrier, context=trace.set_span_in_context(span))
    return span, carrier.get(TRACEPARENT_KEY, parent)


class TraceIdFilter(logging.Filter):
    """Adds `trace_id` (the current request's, or '-') to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.trace_id = _trace_id.get()
        return True


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [trace=%(trace_id)s]: %(message)s"


def configure_logging(level: str | int) -> None:
    """basicConfig with the trace id in every line (the entry points call this)."""
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, TraceIdFilter) for f in handler.filters):
            handler.addFilter(TraceIdFilter())


def configure(service: str) -> bool:
    """Turn spans on for this process when the environment asks for an exporter; -> whether
    they are on. Idempotent. The service name is OTEL_SERVICE_NAME or microserving-<service>."""
    global _tracer
    if _tracer is not None:
        return True
    exporter = _exporter_from_env()
    if exporter is None:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        logger.warning("tracing asked for (%s) but opentelemetry-sdk is not installed: "
                       "pip install 'microserving-grpc[otel]'", exporter)
        return False
    name = os.environ.get("OTEL_SERVICE_NAME") or f"microserving-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    span_exporter = _build_exporter(exporter)
    if span_exporter is None:
        return False
    # A file or the console: written as each span ends (the process may be killed).
    simple = exporter in ("file", "console")
    provider.add_span_processor(SimpleSpanProcessor(span_exporter) if simple else BatchSpanProcessor(span_exporter))
    _tracer = provider.get_tracer("microserving")
    logger.info("tracing on: %s exporter, service %s", exporter, name)
    return True


def _exporter_from_env() -> str | None:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    if os.environ.get("MICROSERVING_TRACE_FILE"):
        return "file"
    chosen = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if chosen in ("otlp", "console"):
        return chosen
    if chosen == "" and (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                         or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return "otlp"
    return None


def _build_exporter(kind: str) -> Any:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    if kind == "file":
        out = open(os.environ["MICROSERVING_TRACE_FILE"], "a", encoding="utf-8")  # noqa: SIM115 - open for the process's life
        return ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
    if kind == "console":
        return ConsoleSpanExporter()
    return _otlp_exporter(_otlp_protocol())


def _otlp_protocol() -> str:
    """The standard OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL; http/protobuf when unset, the
    specification's default (and the collector's port 4318)."""
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported: "
                         "use http/protobuf or grpc")
    return protocol


def _otlp_exporter(protocol: str) -> Any:
    package = "opentelemetry-exporter-otlp-proto-" + ("grpc" if protocol == "grpc" else "http")
    try:  # each reads the standard OTEL_EXPORTER_OTLP_* variables itself
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
    except ImportError:
        logger.warning("OTLP tracing asked for but %s is not installed: "
                       "pip install 'microserving-grpc[otel]'", package)
        return None
    return OTLPSpanExporter()
