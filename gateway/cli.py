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
from gateway.workers import ReusePortWorkers, reuse_port_balances, tcp_socket
from microserving import cpu_latency
from microserving.tracing import configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="microserving gateway",
                                     description="OpenAI-compatible HTTP gateway to a router.")
    parser.add_argument("--router", help="Router address host:port (default 127.0.0.1:50051); "
                        "several comma-separated for router replicas")
    parser.add_argument("--workers", type=int,
                        help="worker processes sharing the HTTP port (default 1)")
    parser.add_argument("--reuse-port", action=argparse.BooleanOptionalAction, default=None,
                        help="with --workers: a listening socket per worker (SO_REUSEPORT, the "
                             "kernel spreads connections evenly; default on Linux) or one shared")
    parser.add_argument("--worker-hang-timeout-s", type=float,
                        help="with a socket per worker: replace a worker whose loop has not "
                             "answered a ping for this long (default 30)")
    parser.add_argument("--cpu-latency-us",
                        help="hold this bound on the host's CPU wake-up latency while serving "
                             "(/dev/cpu_dma_latency, needs root; 0: idle CPUs poll; default off)")
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
    """The listening socket of one process (or of every worker, sharing it)."""
    return tcp_socket(host, port)


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
    if not cpu_latency.hold_for_service(settings.cpu_latency_us, "microserving gateway"):  # until the exit
        return 1
    own_sockets = settings.workers > 1 and settings.reuse_port and reuse_port_balances()
    try:
        # With a socket per worker, the parent's holds the port (bound, never listening:
        # it takes no connections) while the workers bind theirs beside it.
        sock = (tcp_socket(settings.host, settings.port, reuse_port=True, listen=False)
                if own_sockets else bind_socket(settings.host, settings.port))
    except OSError as error:
        print(f"microserving gateway: cannot listen on {settings.host}:{settings.port}: "
              f"{error.strerror}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    listening = (f"microserving gateway listening on {host}:{port} ({router_text}, "
                 f"{settings.workers} worker{'s' if settings.workers > 1 else ''})")
    if settings.workers > 1:
        _run_workers(settings, sock, worker_factory, listening, own_sockets)
        return 0
    print(listening, flush=True)
    config = uvicorn.Config(build_app(), log_level=settings.log_level,
                            access_log=False, timeout_graceful_shutdown=5,
                            http=header_timeout_protocol(settings.header_timeout_s))
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _run_workers(settings: GatewaySettings, sock: socket.socket, worker_factory: str,
                 listening: str, own_sockets: bool) -> None:
    """`settings.workers` processes, each building its app from the environment: each on a
    socket of its own in the port's SO_REUSEPORT group (gateway/workers.py: the kernel spreads
    connections evenly), or with `own_sockets` false under uvicorn's supervisor, all sharing
    `sock`. Their Prometheus metrics are summed through a shared directory
    (prometheus-client's multiprocess mode), so /metrics on any worker reports the whole
    gateway. `listening` is printed once every worker takes connections."""
    os.environ[WORKER_SETTINGS_ENV] = worker_settings_json(settings)
    with tempfile.TemporaryDirectory(prefix="microserving-gateway-metrics-") as metrics_dir:
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", metrics_dir)
        config = uvicorn.Config(worker_factory, factory=True,
                                workers=settings.workers, log_level=settings.log_level,
                                access_log=False, timeout_graceful_shutdown=5,
                                http=WORKER_PROTOCOL)
        if not own_sockets:
            print(listening, flush=True)  # the shared socket queues connections already
            Multiprocess(config, sockets=[sock]).run()
            return
        try:
            ReusePortWorkers(config, sock, settings.workers, settings.worker_hang_timeout_s).run(
                lambda: print(listening, flush=True))
        except RuntimeError as error:
            print(f"microserving gateway: {error}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None


if __name__ == "__main__":
    sys.exit(main())
