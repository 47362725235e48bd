"""`microserving up`: a whole local stack from one command.

Starts each engine shim as its own process (`python -m microserving.cli shim ... --role R`), then
the router over them, then the gateway; waits for each to be healthy (showing progress while
models load); prints the base URL; and on Ctrl-C / SIGTERM, or when any child dies, stops
everything in reverse order (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from microserving.pattern_names import PATTERN_NAMES
from microserving.stack.health import is_grpc_serving, is_http_healthy
from microserving.stack.process import ServiceProcess
from microserving.tokenizer import MODEL_HELP
from microserving.transport import TransportSettings

INTERNAL_HOST = "127.0.0.1"
_PROGRESS_EVERY_S = 5.0


@dataclass(frozen=True)
class StackPlan:
    model: str
    pattern: str
    roles: tuple[str, ...]  # one entry per shim
    pd_balance_factor: float | None
    device: str
    host: str
    port: int
    router_port: int
    gateway_args: tuple[str, ...]
    startup_timeout_s: float
    grace_s: float
    transport: TransportSettings = TransportSettings()  # every gRPC hop of the stack
    router_args: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()  # handed to the gateway in its environment, never in argv
    gateway_workers: int = 1
    router_replicas: int = 1
    shim_args: tuple[str, ...] = ()
    metrics_base_port: int | None = None  # routers' /metrics from here, then the shims'
    cpu_threads: int = 0  # torch threads of each embedded CPU engine; 0: the shim's default
    # `microserving serve`: the router in the gateway's process(es), with these settings
    # besides its engines (router_replicas is then 0: no router process).
    router_in_gateway: bool = False
    router_settings: dict[str, Any] = field(default_factory=dict)

    def metrics_port(self, service: str, index: int) -> int | None:
        """The /metrics port of router replica or shim `index` (the gateway serves its own
        on its HTTP port)."""
        if self.metrics_base_port is None:
            return None
        offset = index if service == "router" else self.router_replicas + index
        return self.metrics_base_port + offset


def default_process_counts(num_cpus: int) -> tuple[int, int]:
    """(gateway workers, router replicas) for a host with `num_cpus` CPUs: one Python process
    relays at most one core's worth of tokens, so a big host gets several of each, leaving
    most cores to the engines (each engine shim keeps a core for its own serving)."""
    gateway_workers = max(1, min(4, num_cpus // 4))
    router_replicas = max(1, min(4, num_cpus // 8))
    return gateway_workers, router_replicas


def cpu_threads_per_engine(num_cpus: int, num_engines: int) -> int:
    """Each embedded CPU engine's share of the host's cores. Torch would give every engine a
    thread per core; several engines' OpenMP threads then spin against each other (on 2
    cores, 3 engines stepped 30x slower than with one thread each)."""
    return max(1, num_cpus // max(1, num_engines))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="microserving up", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help=MODEL_HELP)
    parser.add_argument("--pattern", choices=PATTERN_NAMES,
                        help="orchestration pattern (default disagg; round-robin: engines that do both, 2 unless --engines N)")
    parser.add_argument("--engines", type=int, help="N engines that each do prefill and decode")
    parser.add_argument("--prefill", type=int, help="prefill engines (default 1)")
    parser.add_argument("--decode", type=int, help="decode engines (default 1)")
    parser.add_argument("--pd-balance-factor", type=float, help="disagg: fraction D prefills")
    parser.add_argument("--router-class", metavar="PACKAGE.MODULE:CLASS",
                        help="a Router subclass the router runs (imported from PYTHONPATH or "
                             "the working directory); engines in order: prefill, then decode")
    parser.add_argument("--enable-prefix-cache", choices=["true", "false"],
                        help="engines reuse KV of shared prompt prefixes (default true)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    parser.add_argument("--port", type=int, default=8000, help="gateway port; 0 picks one")
    parser.add_argument("--router-port", type=int, default=50051, help="router port; 0 picks one")
    parser.add_argument("--api-key", action="append", default=[], help="gateway API key")
    parser.add_argument("--max-inflight", type=int, help="gateway admission limit")
    parser.add_argument("--router-max-inflight", type=int, help="router admission limit")
    parser.add_argument("--tls-cert", help="PEM certificate (server and client) of every service")
    parser.add_argument("--tls-key", help="PEM key of --tls-cert")
    parser.add_argument("--tls-ca", help="CA bundle: mutual TLS on every gRPC hop")
    parser.add_argument("--tls-server-name", help="name to check in the certificates")
    parser.add_argument("--internal-token", action="store_true",
                        help="require the shared token of MICROSERVING_INTERNAL_TOKEN on every "
                             "gRPC hop (read from the environment so it never shows in ps)")
    parser.add_argument("--gateway-workers", type=int,
                        help="gateway worker processes (default: from the CPU count, 1 per 4 "
                             "CPUs, at most 4)")
    parser.add_argument("--router-replicas", type=int,
                        help="router processes, the gateway spreading requests over them "
                             "(default: 1 per 8 CPUs, at most 4)")
    parser.add_argument("--router-in-gateway", action="store_true",
                        help="run the router inside the gateway's process(es) (`microserving "
                             "serve`): no router process, no router port")
    parser.add_argument("--shim-arg", action="append", default=[],
                        help="extra argument for every shim, e.g. --shim-arg=--backend=synthetic")
    parser.add_argument("--metrics-base-port", type=int,
                        help="serve Prometheus /metrics of router replica i on this port + i and "
                             "of shim j on this port + replicas + j (default: none; the gateway's "
                             "is always on its own port)")
    parser.add_argument("--cpu-latency-us",
                        help="the gateway holds this bound on the host's CPU wake-up latency "
                             "while it runs (/dev/cpu_dma_latency, needs root; 0: idle CPUs "
                             "poll instead of halting; default off)")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0,
                        help="seconds every service together gets to become healthy")
    parser.add_argument("--grace-s", type=float, default=10.0, help="stop grace per process")
    return parser


def plan_from_args(argv: list[str]) -> StackPlan:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.engines is not None and (args.prefill is not None or args.decode is not None):
        parser.error("give either --engines or --prefill/--decode")
    if args.engines is not None:
        if args.engines < 1:
            parser.error("--engines must be at least 1")
        if args.pattern not in (None, "round-robin"):
            parser.error(f"--pattern {args.pattern} needs --prefill/--decode engines")
        roles = ("both",) * args.engines
        pattern = "round-robin"
    elif args.pattern == "round-robin":
        # Round-robin never disaggregates: every engine does both, so a prefill-only engine
        # would never get a request.
        if args.prefill is not None or args.decode is not None:
            parser.error("--pattern round-robin runs engines that do both: give --engines N")
        roles = ("both",) * 2
        pattern = "round-robin"
    else:
        num_prefill = 1 if args.prefill is None else args.prefill
        num_decode = 1 if args.decode is None else args.decode
        if num_decode < 1 or num_prefill < 0:
            parser.error("need at least one decode engine")
        pattern = args.pattern or "disagg"
        if pattern != "round-robin" and num_prefill < 1:
            parser.error(f"--pattern {pattern} needs at least one prefill engine")
        roles = ("prefill",) * num_prefill + ("decode",) * num_decode
    gateway_args: list[str] = []
    if args.max_inflight is not None:
        gateway_args += ["--max-inflight", str(args.max_inflight)]
    if args.cpu_latency_us is not None:  # one holder a host: the gateway's process
        gateway_args += ["--cpu-latency-us", args.cpu_latency_us]
    router_extra: tuple[str, ...] = ()
    router_settings: dict[str, Any] = {}
    if args.router_max_inflight is not None:
        router_extra = ("--max-inflight", str(args.router_max_inflight))
        router_settings["max_inflight"] = args.router_max_inflight
    if args.router_class is not None:
        router_extra += ("--router-class", args.router_class)
        router_settings["router_class"] = args.router_class
    if args.pd_balance_factor is not None:
        router_settings["pd_balance_factor"] = args.pd_balance_factor
    shim_extra: tuple[str, ...] = ()
    if args.enable_prefix_cache is not None:
        shim_extra = ("--enable-prefix-cache", args.enable_prefix_cache)
    token = os.environ.get("MICROSERVING_INTERNAL_TOKEN") if args.internal_token else None
    if args.internal_token and not token:
        parser.error("--internal-token needs MICROSERVING_INTERNAL_TOKEN in the environment")
    transport = TransportSettings(tls_cert=args.tls_cert, tls_key=args.tls_key,
                                  tls_ca=args.tls_ca, token=token,
                                  tls_server_name=args.tls_server_name)
    auto_workers, auto_replicas = default_process_counts(os.cpu_count() or 1)
    gateway_workers = auto_workers if args.gateway_workers is None else args.gateway_workers
    router_replicas = auto_replicas if args.router_replicas is None else args.router_replicas
    if gateway_workers < 1 or router_replicas < 1:
        parser.error("--gateway-workers and --router-replicas must be at least 1")
    if args.router_in_gateway:
        if args.router_replicas is not None:
            parser.error("--router-in-gateway runs a router in each gateway worker: "
                         "no --router-replicas")
        router_replicas = 0
    if gateway_workers > 1:
        gateway_args += ["--workers", str(gateway_workers)]
    shim_args = tuple(args.shim_arg) + shim_extra
    cpu_threads = 0
    if args.device == "cpu" and not any(a.startswith("--cpu-threads") for a in shim_args):
        cpu_threads = cpu_threads_per_engine(os.cpu_count() or 1, len(roles))
    return StackPlan(args.model, pattern, roles, args.pd_balance_factor, args.device, args.host,
                     args.port, args.router_port, tuple(gateway_args), args.startup_timeout_s,
                     args.grace_s, transport, router_extra, tuple(args.api_key),
                     gateway_workers, router_replicas, shim_args, args.metrics_base_port,
                     cpu_threads, args.router_in_gateway, router_settings)


def _command(subcommand: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "microserving.cli", subcommand, *args]


def _metrics_args(port: int | None) -> tuple[str, ...]:
    return () if port is None else ("--metrics-port", str(port))


def shim_command(plan: StackPlan, role: str, index: int = 0) -> list[str]:
    backend = () if any(a.startswith("--backend") for a in plan.shim_args) else ("--backend", "embedded")
    threads = ("--cpu-threads", str(plan.cpu_threads)) if plan.cpu_threads else ()
    return _command("shim", *backend, "--model", plan.model, "--role", role,
                    "--device", plan.device, *threads, "--host", INTERNAL_HOST, "--port", "0",
                    *_metrics_args(plan.metrics_port("shim", index)), *plan.shim_args)


def router_command(plan: StackPlan, engines: list[tuple[str, str]], port: int | None = None,
                   index: int = 0) -> list[str]:
    args = ["--pattern", plan.pattern, "--model", plan.model, "--host", INTERNAL_HOST,
            "--port", str(plan.router_port if port is None else port),
            *_metrics_args(plan.metrics_port("router", index))]
    for address, role in engines:
        args += ["--engine", f"{address}={role}"]
    if plan.pd_balance_factor is not None:
        args += ["--pd-balance-factor", str(plan.pd_balance_factor)]
    return _command("router", *args, *plan.router_args)


def transport_env(prefix: str, transport: TransportSettings) -> dict[str, str]:
    """The child's environment: ours plus its service's TLS / token variables (the token
    travels in the environment, never on a command line)."""
    values = {"TLS_CERT": transport.tls_cert, "TLS_KEY": transport.tls_key,
              "TLS_CA": transport.tls_ca, "TOKEN": transport.token,
              "TLS_SERVER_NAME": transport.tls_server_name}
    env = dict(os.environ)
    env.update({f"MICROSERVING_{prefix}_{name}": value for name, value in values.items() if value})
    return env


def gateway_command(plan: StackPlan, router_address: str) -> list[str]:
    return _command("gateway", "--router", router_address, "--host", plan.host,
                    "--port", str(plan.port), *plan.gateway_args)


def serve_command(plan: StackPlan, router_config: Path) -> list[str]:
    return _command("serve", "--router-config", str(router_config), "--host", plan.host,
                    "--port", str(plan.port), *plan.gateway_args)


def router_config(plan: StackPlan, engines: list[tuple[str, str]]) -> dict[str, Any]:
    """The settings file of the router `microserving serve` runs (what `router_command` gives
    a router process as flags; its TLS and token come from the environment, as there)."""
    return {"engines": [f"{address}={role}" for address, role in engines],
            "pattern": plan.pattern, "model": plan.model, **plan.router_settings}


class StartupFailed(Exception):
    pass


def check_ports_free(plan: StackPlan) -> None:
    """Fails at once on a taken gateway or router port, not after the engines have loaded."""
    for flag, host, port in (("--port", plan.host, plan.port),
                             ("--router-port", INTERNAL_HOST, plan.router_port)):
        if port == 0 or (flag == "--router-port" and plan.router_in_gateway):
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            try:
                sock.bind((host, port))
            except OSError as error:
                raise StartupFailed(f"{host}:{port} ({flag}) is not free: {error.strerror}") from None


class Stack:
    """The running children, in start order; `stop` ends them in reverse order."""

    def __init__(self, plan: StackPlan) -> None:
        self.plan = plan
        self.children: list[ServiceProcess] = []
        self.stopping = threading.Event()
        self.exited: ServiceProcess | None = None
        self.files: list[Path] = []  # written for the children; removed at stop

    def _on_exit(self, child: ServiceProcess) -> None:
        if not self.stopping.is_set():
            self.exited = child
            self.stopping.set()

    def spawn(self, name: str, argv: list[str], env_prefix: str,
              api_keys: bool = False) -> ServiceProcess:
        env = transport_env(env_prefix, self.plan.transport)
        if (env_prefix == "GATEWAY" or api_keys) and self.plan.api_keys:
            env["MICROSERVING_GATEWAY_API_KEYS"] = ",".join(self.plan.api_keys)
        child = ServiceProcess(name, argv, env=env, on_line=_relay_as(name), on_exit=self._on_exit,
                               dies_with_parent=True)
        self.children.append(child)
        _say(f"started {name} (pid {child.pid}): {' '.join(argv[1:])}")
        return child

    def wait_ready(self, child: ServiceProcess, is_ready: Callable[[str], bool],
                   deadline_s: float) -> str:
        """Waits for the child's address, then for its health check; returns the address."""
        started_s = time.monotonic()
        next_progress_s = started_s + _PROGRESS_EVERY_S
        while True:
            if self.stopping.is_set():
                raise StartupFailed(self._why_stopped())
            if child.is_listening and is_ready(child.address):
                _say(f"{child.name} ready on {child.address} "
                     f"({time.monotonic() - started_s:.1f} s)")
                return child.address
            now = time.monotonic()
            if now > deadline_s:
                raise StartupFailed(f"{child.name} not ready after {now - started_s:.0f} s")
            if now >= next_progress_s:
                stage = "waiting for health" if child.is_listening else "loading"
                _say(f"{child.name}: {stage} ... {now - started_s:.0f} s")
                next_progress_s = now + _PROGRESS_EVERY_S
            self.stopping.wait(0.25 if child.is_listening else 0.2)

    def _why_stopped(self) -> str:
        if self.exited is not None:
            return f"{self.exited.name} exited with code {self.exited.returncode}"
        return "interrupted"

    def start(self) -> str:
        plan = self.plan
        check_ports_free(plan)
        deadline_s = time.monotonic() + plan.startup_timeout_s
        shims = [self.spawn(f"{role}-{i}", shim_command(plan, role, i), "SHIM")
                 for i, role in enumerate(plan.roles)]

        def is_serving(address: str) -> bool:
            return is_grpc_serving(address, transport=plan.transport)

        engines = [(self.wait_ready(s, is_serving, deadline_s), r)
                   for s, r in zip(shims, plan.roles, strict=True)]
        if plan.router_in_gateway:
            # A router of its own in each gateway worker; its transport (the engines' TLS and
            # token) from the ROUTER environment, as a router process gets it.
            config = self._write_router_config(router_config(plan, engines))
            gateway = self.spawn("gateway", serve_command(plan, config), "ROUTER", api_keys=True)
            address = self.wait_ready(gateway, lambda a: is_http_healthy(f"http://{a}/health"),
                                      deadline_s)
            return f"http://{address}/v1"
        # The first replica on --router-port, any others on free ports.
        routers = [self.spawn("router" if i == 0 else f"router-{i}",
                              router_command(plan, engines, None if i == 0 else 0, i), "ROUTER")
                   for i in range(plan.router_replicas)]
        router_address = ",".join(self.wait_ready(r, is_serving, deadline_s) for r in routers)
        gateway = self.spawn("gateway", gateway_command(plan, router_address), "GATEWAY")
        address = self.wait_ready(gateway, lambda a: is_http_healthy(f"http://{a}/health"),
                                  deadline_s)
        return f"http://{address}/v1"

    def _write_router_config(self, settings: dict[str, Any]) -> Path:
        handle, name = tempfile.mkstemp(prefix="microserving-up-router-", suffix=".json")
        with os.fdopen(handle, "w") as out:
            json.dump(settings, out)
        self.files.append(Path(name))
        return Path(name)

    def stop(self) -> None:
        self.stopping.set()
        for child in reversed(self.children):
            child.stop(self.plan.grace_s)
        for path in self.files:
            path.unlink(missing_ok=True)


def _relay_as(name: str) -> Callable[[str], None]:
    """A child's output line on our stderr, prefixed with its name."""
    def relay(line: str) -> None:
        sys.stderr.write(f"[{name}] {line}")
        sys.stderr.flush()
    return relay


def _say(message: str) -> None:
    sys.stderr.write(f"microserving up: {message}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    plan = plan_from_args(sys.argv[1:] if argv is None else argv)
    stack = Stack(plan)
    interrupted = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        interrupted.set()
        stack.stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        url = stack.start()
        print(f"microserving up: ready at {url}", flush=True)
        routers = ("a router in each gateway worker" if plan.router_in_gateway
                   else f"{plan.router_replicas} router(s)")
        _say(f"pattern {plan.pattern}, engines {', '.join(plan.roles)}, "
             f"{routers}, {plan.gateway_workers} gateway worker(s); "
             "Ctrl-C stops everything")
        stack.stopping.wait()
        if not interrupted.is_set():
            _say(f"stopping: {stack._why_stopped()}")
            return 1
        return 0
    except StartupFailed as error:
        if interrupted.is_set():
            return 0
        _say(f"startup failed: {error}")
        return 1
    finally:
        _say("stopping all services")
        stack.stop()
        _say("stopped")
