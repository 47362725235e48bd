"""`microserving gateway`: flags -> GatewaySettings -> uvicorn serving the FastAPI app.

Binds its socket itself so that `--port 0` works, and prints the bound address as
`microserving gateway listening on HOST:PORT` (the line `microserving up` waits for).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError
from uvicorn.supervisors import Multiprocess

from gateway.app import create_app
from gateway.header_timeout import WORKER_PROTOCOL, header_timeout_protocol
from gateway.settings import (
    WORKER_SETTINGS_ENV,
    GatewaySettings,
    reject_unknown_env,
    worker_settings_json,
)
from microserving.tracing import configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="microserving gateway",
                                     description="OpenAI-compatible HTTP gateway to a router.")
    parser.add_argument("--router", help="Router address host:port (default 127.0.0.1:50051); "
                        "several comma-separated for router replicas")
    parser.add_argument("--workers", type=int,
                        help="worker processes sharing the HTTP port (default 1)")
    parser.add_argument("--host", help="HTTP bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port, 0 for any (default 8000)")
    parser.add_argument("--api-key", dest="api_keys", action="append",
                        help="accepted API key (repeatable; also MICROSERVING_GATEWAY_API_KEYS)")
    parser.add_argument("--api-key-file", help="file with one accepted API key per line")
    parser.add_argument("--max-inflight", type=int,
                        help="generation requests served at once; 0 = unlimited (default)")
    parser.add_argument("--max-body-bytes", type=int,
                        help="largest request body; larger ones get 413 unread (default 16 MiB)")
    parser.add_argument("--body-timeout-s", type=float,
                        help="seconds to send a request body before 408 (default 60)")
    parser.add_argument("--header-timeout-s", type=float,
                        help="seconds to complete request headers before the connection closes "
                             "(default 10)")
    parser.add_argument("--max-choices-per-request", type=int,
                        help="most completions (prompts x n) one request may ask for (default 256)")
    parser.add_argument("--router-streams", type=int,
                        help="most long-lived Router.Generate calls to multiplex requests on (default 16)")
    parser.add_argument("--requests-per-router-stream", type=int,
                        help="open requests per call before another is opened (default 16)")
    parser.add_argument("--served-model-name", help="model id to report when none is given")
    parser.add_argument("--log-level", help="log level (default info)")
    parser.add_argument("--tls-ca", help="CA bundle verifying the router (TLS)")
    parser.add_argument("--tls-cert", help="client certificate (mutual TLS)")
    parser.add_argument("--tls-key", help="client key (mutual TLS)")
    parser.add_argument("--tls-server-name", help="override of the name in the router's cert")
    parser.add_argument("--token", help="shared bearer token of the gRPC hops "
                        "(prefer MICROSERVING_GATEWAY_TOKEN: flags show in ps)")
    return parser


def settings_from_args(argv: list[str]) -> GatewaySettings:
    """Flags given on the command line override the environment (MICROSERVING_GATEWAY_*)."""
    return settings_from_namespace(build_parser().parse_args(argv))


def settings_from_namespace(args: argparse.Namespace) -> GatewaySettings:
    """The settings of `build_parser()`'s flags (None: not given) over the environment."""
    reject_unknown_env()
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if v is not None}
    return GatewaySettings(**given)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio turns on TCP_NODELAY only for sockets whose proto
    # says TCP, and accepted sockets inherit it; without it Nagle holds back the first SSE
    # chunk of a reused connection for ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    try:
        settings = settings_from_args(sys.argv[1:] if argv is None else argv)
    except (ValidationError, ValueError) as error:
        print(f"microserving gateway: {error}", file=sys.stderr)
        return 2
    return serve(settings, lambda: create_app(settings, freeze_heap=True),
                 "gateway.app:app_from_worker_env", f"router {settings.router}")


def serve(settings: GatewaySettings, build_app: Callable[[], FastAPI], worker_factory: str,
          router_text: str) -> int:
    """Binds the HTTP socket, says so, then serves `build_app()` (one process) or
    `settings.workers` processes that each build theirs with `worker_factory` (an import path
    that uvicorn calls, reading the settings from the environment)."""
    configure_logging(settings.log_level)
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as error:
        print(f"microserving gateway: cannot listen on {settings.host}:{settings.port}: "
              f"{error.strerror}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    print(f"microserving gateway listening on {host}:{port} ({router_text}, "
          f"{settings.workers} worker{'s' if settings.workers > 1 else ''})", flush=True)
    if settings.workers > 1:
        _run_workers(settings, sock, worker_factory)
        return 0
    config = uvicorn.Config(build_app(), log_level=settings.log_level,
                            access_log=False, timeout_graceful_shutdown=5,
                            http=header_timeout_protocol(settings.header_timeout_s))
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _run_workers(settings: GatewaySettings, sock: socket.socket, worker_factory: str) -> None:
    """uvicorn's supervisor runs `settings.workers` processes on the one listening socket (the
    kernel spreads connections over them); each builds its app from the environment. Their
    Prometheus metrics are summed through a shared directory (prometheus-client's
    multiprocess mode), so /metrics on any worker reports the whole gateway."""
    os.environ[WORKER_SETTINGS_ENV] = worker_settings_json(settings)
    with tempfile.TemporaryDirectory(prefix="microserving-gateway-metrics-") as metrics_dir:
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", metrics_dir)
        config = uvicorn.Config(worker_factory, factory=True,
                                workers=settings.workers, log_level=settings.log_level,
                                access_log=False, timeout_graceful_shutdown=5,
                                http=WORKER_PROTOCOL)
        Multiprocess(config, sockets=[sock]).run()


if __name__ == "__main__":
    sys.exit(main())
