"""`microserving router`: a thin argparse layer over RouterSettings (flags > environment >
--config file > defaults)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from pydantic import ValidationError

from microserving import cpu_latency, tracing
from microserving.event_loop import loop_runner
from microserving.pattern_names import PATTERN_NAMES
from microserving.tokenizer import MODEL_HELP
from microserving.tracing import configure_logging
from router.router import Router
from router.router_class import load_router_class
from router.server import serve_forever
from router.settings import load_settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="microserving router", description="Run the gRPC router.")
    add = parser.add_argument
    add("--config", help="YAML or JSON file of settings (field names as keys)")
    add("--engine", dest="engines", action="append", metavar="HOST:PORT[=ROLE]",
        help="an engine shim; ROLE is prefill, decode or both (repeatable)")
    add("--engine-dns", dest="engine_dns", action="append", metavar="NAME:PORT=ROLE",
        help="a DNS name re-resolved periodically, e.g. a headless Service (repeatable)")
    add("--engine-num-gpus", dest="engine_num_gpus", type=int, nargs="+", help="GPUs per --engine")
    add("--pattern", choices=PATTERN_NAMES,
        help="default orchestration pattern (round-robin: least loaded engine does all)")
    add("--router-class", metavar="PACKAGE.MODULE:CLASS",
        help="a Router subclass to run (e.g. my_router:CustomRouter, imported from PYTHONPATH)")
    add("--pd-balance-factor", type=float, help="disagg: fraction of the prompt the decode engine prefills (0..1)")
    add("--cache-aware", action="store_true", default=None,
        help="prefer engines whose prefix cache holds the prompt")
    add("--model", help=MODEL_HELP + " (the router tokenizes with it)")
    add("--model-id", help="id clients pass as model (default: from --model)")
    add("--host", help="address to bind (default 127.0.0.1)")
    add("--port", type=int, help="gRPC port; 0 picks a free one (default 50051)")
    add("--metrics-port", type=int, help="HTTP port of Prometheus /metrics; 0 picks a free one (default: none)")
    add("--health-interval-s", type=float, help="seconds between health/status polls per engine")
    add("--first-token-timeout-s", type=float, help="deadline for an engine's first streamed message")
    add("--inter-token-timeout-s", type=float, help="deadline between an engine's streamed messages")
    add("--prep-recv-timeout-s", type=float, help="deadline of a PrepRecv call")
    add("--remote-send-timeout-s", type=float, help="deadline of a RemoteSend call")
    add("--max-attempts", type=int,
        help="engine attempts per request: retries before the first token, resumes after it")
    add("--max-inflight", type=int, help="requests served at once; 0 = unlimited (RESOURCE_EXHAUSTED over it)")
    add("--health-timeout-s", type=float, help="deadline of one health check or GetStatus")
    add("--kv-full-wait-s", type=float,
        help="seconds a request waits for KV room when every engine is full, then RESOURCE_EXHAUSTED")
    add("--engine-stream", action=argparse.BooleanOptionalAction, default=None,
        help="decode over one multiplexed Engine.Generate stream per engine (default), or "
        "--no-engine-stream: one StartGenerate call per request")
    add("--start-after-kv", action=argparse.BooleanOptionalAction, default=None,
        help="disaggregation: start the decode engine's request with the prefill engine's RemoteSend, "
        "to begin as the KV lands (default), or --no-start-after-kv: after RemoteSend returns")
    add("--send-ahead", action=argparse.BooleanOptionalAction, default=None,
        help="disagg: make P's RemoteSend together with D's PrepRecv, D's address following on "
        "P's engine stream (default), or --no-send-ahead: RemoteSend after PrepRecv returns")
    add("--first-token-on-prefill", action=argparse.BooleanOptionalAction, default=None,
        help="disagg: the prefill engine samples the first token, which reaches the client before "
        "the KV transfer and D's first step (default, where both engines serve it), or "
        "--no-first-token-on-prefill: MLC's protocol, D samples every token")
    add("--engine-stream-batches", action=argparse.BooleanOptionalAction, default=None,
        help="send the actions queued on an engine's stream together, in one message (default), "
        "or --no-engine-stream-batches: a message each")
    add("--cpu-latency-us", help="hold this bound on the host's CPU wake-up latency while serving "
        "(/dev/cpu_dma_latency, needs root; 0: idle CPUs poll; default off)")
    add("--token", help="shared bearer token for every hop (prefer MICROSERVING_ROUTER_TOKEN: flags show in ps)")
    add("--tls-cert", help="PEM certificate of this router (serves TLS; client cert to engines)")
    add("--tls-key", help="PEM key of --tls-cert")
    add("--tls-ca", help="CA bundle: verifies engines; on the server, requires client certificates")
    add("--tls-server-name", help="override of the name checked in the engines' certificates")
    add("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    tracing.configure("router")
    overrides: dict[str, Any] = {
        key: value for key, value in vars(args).items()
        if value is not None and key not in ("config", "log_level")
    }
    try:
        settings = load_settings(args.config, **overrides)
    except (ValidationError, ValueError, OSError) as exc:
        print(f"microserving router: invalid settings: {exc}", file=sys.stderr)
        return 2
    try:
        router_type = load_router_class(settings.router_class) if settings.router_class else Router
        router = router_type(settings=settings)
    except ValueError as exc:
        print(f"microserving router: {exc}", file=sys.stderr)
        return 2
    if not cpu_latency.hold_for_service(settings.cpu_latency_us, "microserving router"):  # until the exit
        return 1
    with contextlib.suppress(KeyboardInterrupt):
        loop_runner(settings.event_loop)(serve_forever(router, settings.host, settings.port))
    return 0
