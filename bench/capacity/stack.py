"""One stack of real processes per pattern: synthetic shims (benchmark-only backend), the router
and the gateway, started from their entry points by bench/procs.py; and the CPU counters of
each, read from /proc (a service's whole process group; a shim's engine thread apart)."""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from bench.capacity.cpu import group_cpu_s, thread_cpu_s
from bench.control_plane_run import wait_grpc_serving, wait_http_ready
from bench.procs import ServiceGroup
from microserving.stack.process import ServiceProcess, free_ports

# Printed by the synthetic backend once its engine thread runs (engine_shim/backends/synthetic/backend.py).
_ENGINE_THREAD = re.compile(r"engine thread native id (\d+)")

ROLES = {"round-robin": ("both",), "disagg": ("prefill", "decode")}


@dataclass(frozen=True)
class StackOptions:
    model: str = "tiny"
    step_ms: str | None = None  # None: the synthetic backend's default profile
    prefill_tok_s: float | None = None
    max_num_seqs: int = 256
    gateway_workers: int = 1  # the gateway's --workers (its processes share its group)
    router_replicas: int = 1  # router processes, all given to the gateway's --router
    router_args: tuple[str, ...] = ()
    embed_router: bool = False  # the router inside the gateway: `microserving serve`
    startup_timeout_s: float = 120.0
    backend: str = "synthetic"  # or "embedded": the real engine (e.g. on a GPU)
    device: str = "cpu"
    shim_args: tuple[str, ...] = ()  # e.g. ("--stream-updates-per-s", "0")
    env: tuple[tuple[str, str], ...] = ()  # set in every process's environment
    label: str = ""  # after the pattern in the processes' log names (stacks one after another)


@dataclass
class StackProcess:
    name: str  # gateway | router | shim-<role>
    service: ServiceProcess
    engine_tid: int | None = None  # shims only

    def cpu_s(self) -> tuple[float, float]:
        """(CPU of the process group, CPU of its engine thread) in seconds."""
        pid = self.service.process.pid
        # The thread first: the group read after it includes all the thread has used by
        # then, so at both ends the group minus the thread errs the same way.
        engine_s = thread_cpu_s(self.engine_tid) if self.engine_tid else 0.0
        return group_cpu_s(pid), engine_s  # started with its own session: pgid == pid


@dataclass
class Stack:
    pattern: str
    base_url: str
    processes: list[StackProcess] = field(default_factory=list)
    router_metrics_ports: list[int] = field(default_factory=list)  # each router's /metrics
    shim_metrics_ports: dict[str, int] = field(default_factory=dict)  # each shim's, by name
    gateway_metrics_port: int | None = None  # the gateway's (its HTTP port), every worker's

    def cpu_s(self) -> dict[str, tuple[float, float]]:
        return {p.name: p.cpu_s() for p in self.processes}

    def process_groups(self) -> list[int]:
        """The services' process groups (each started in a session of its own)."""
        return [p.service.process.pid for p in self.processes]


def _shim_args(role: str, options: StackOptions) -> list[str]:
    args = ["shim", "--backend", options.backend, "--model", options.model, "--role", role,
            "--host", "127.0.0.1", "--port", "0", "--max-num-seqs", str(options.max_num_seqs),
            "--device", options.device, "--log-level", "WARNING"]
    if options.backend == "synthetic" and options.step_ms is not None:
        args += ["--synthetic-step-ms", options.step_ms]
    if options.backend == "synthetic" and options.prefill_tok_s is not None:
        args += ["--synthetic-prefill-tok-s", str(options.prefill_tok_s)]
    return [*args, *options.shim_args]


def engine_tid(service: ServiceProcess) -> int:
    for line in service.output().splitlines():
        if match := _ENGINE_THREAD.search(line):
            return int(match.group(1))
    raise RuntimeError(f"{service.name} did not print its engine thread id ({service.log_path})")


async def start_stack(group: ServiceGroup, pattern: str, options: StackOptions) -> Stack:
    roles = ROLES[pattern]
    env = {**os.environ, **dict(options.env)} if options.env else None
    named = f"{pattern}{options.label}"
    shim_ports = free_ports(len(roles))
    # The shims load side by side (each prints its address once its engine runs).
    shims = await asyncio.gather(*(
        asyncio.to_thread(group.start, f"{named}-shim-{role}",
                          [*_shim_args(role, options), "--metrics-port", str(port)], env=env)
        for role, port in zip(roles, shim_ports, strict=True)
    ))
    processes: list[StackProcess] = []
    engines: list[str] = []
    for role, service in zip(roles, shims, strict=True):
        await wait_grpc_serving(service.address, options.startup_timeout_s)
        processes.append(StackProcess(f"shim-{role}", service, engine_tid(service)))
        engines.append(f"{service.address}={role}")
    workers = [] if options.gateway_workers == 1 else ["--workers", str(options.gateway_workers)]
    if options.embed_router:
        router_names: list[str] = []
        config = _router_config(group, pattern, options, engines)
        gateway = group.start(f"{named}-gateway", [
            "serve", "--router-config", str(config), "--host", "127.0.0.1",
            "--port", "0", "--log-level", "warning", *workers,
        ], env=env)
        routers = []
        # The router's metrics are on the gateway's /metrics (every worker's summed).
        metrics_ports = [int(gateway.address.rsplit(":", 1)[1])]
    else:
        router_names = (["router"] if options.router_replicas == 1
                        else [f"router-{i}" for i in range(options.router_replicas)])
        metrics_ports = free_ports(len(router_names))
        routers = await asyncio.gather(*(
            asyncio.to_thread(group.start, f"{named}-{name}", [
                "router", *(f"--engine={e}" for e in engines), "--pattern", pattern, "--model", options.model,
                "--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING",
                "--metrics-port", str(port), *options.router_args,
            ], env=env)
            for name, port in zip(router_names, metrics_ports, strict=True)
        ))
        for router in routers:
            await wait_grpc_serving(router.address, options.startup_timeout_s)
        gateway = group.start(f"{named}-gateway", [
            "gateway", "--router", ",".join(r.address for r in routers), "--host", "127.0.0.1",
            "--port", "0", "--log-level", "warning", *workers,
        ], env=env)
    base_url = f"http://{gateway.address}/v1"
    await wait_http_ready(f"{base_url[:-3]}/health", options.startup_timeout_s)
    processes = [StackProcess("gateway", gateway),
                 *(StackProcess(n, r) for n, r in zip(router_names, routers, strict=True)),
                 *processes]
    return Stack(pattern, base_url, processes, metrics_ports,
                 {f"shim-{role}": port for role, port in zip(roles, shim_ports, strict=True)},
                 int(gateway.address.rsplit(":", 1)[1]))


def _router_config(group: ServiceGroup, pattern: str, options: StackOptions,
                   engines: list[str]) -> Path:
    """The settings file of the router `microserving serve` runs (`options.router_args` are
    not taken: they are router CLI flags)."""
    if options.router_args:
        raise ValueError("router_args are flags of a router process; not with embed_router")
    path = group.log_dir / f"{pattern}-router.json"
    path.write_text(json.dumps({"engines": engines, "pattern": pattern, "model": options.model}))
    return path
