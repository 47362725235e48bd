"""Control-plane benchmark: the same engines measured at three depths in one run, for each
pattern and concurrency, beside the floors of this machine.

    python -m bench.control_plane --out docs/results/control_plane
    microserving bench control-plane --concurrency 1 64 256 --out DIR

Depths: `direct` (the bench client makes the pattern's engine calls itself over gRPC:
StartGenerate, or PrepRecv -> RemoteSend -> StartGenerate), `router` (Router.Generate) and
`gateway` (HTTP SSE /v1/completions). Floors: a raw grpc.aio echo round trip and a bare FastAPI
SSE endpoint. Every service is a real process started from its entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from bench.control_plane_report import report
from bench.control_plane_run import (
    CellShape,
    grpc_cell,
    http_cell,
    wait_grpc_serving,
    wait_http_ready,
)
from bench.loadgen.results import machine_info
from bench.loadgen.stats import describe
from bench.procs import ServiceGroup, service_group
from bench.stream_clients import DirectFlow, run_direct, run_router
from microserving.pattern_names import PATTERN_NAMES
from microserving.stack.process import ServiceProcess
from microserving.transport import TransportSettings, create_channel
from microserving.v1 import engine_pb2_grpc, router_pb2_grpc

PATTERNS = PATTERN_NAMES  # every pattern the router has


@dataclass(frozen=True)
class ControlPlaneConfig:
    model: str = "tiny"
    patterns: tuple[str, ...] = PATTERNS
    concurrencies: tuple[int, ...] = (1, 64, 256)
    cell: CellShape = field(default_factory=CellShape)
    echo_calls: int = 2000
    rounds: int = 1
    shim_args: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0


def _shim_args(config: ControlPlaneConfig) -> list[str]:
    return ["shim", "--model", config.model, "--role", "both", "--host", "127.0.0.1", "--port",
            "0", *config.shim_args]


async def measure_floors(group: ServiceGroup, config: ControlPlaneConfig) -> dict[str, Any]:
    from bench.floors import echo_round_trips_s

    echo = group.start("echo-floor", ["echo"], module="bench.floors")
    sse = group.start("sse-floor", ["sse"], module="bench.floors")
    floors: dict[str, Any] = {"echo_rtt_s": {}, "sse": {}}
    for c in config.concurrencies:
        times = await echo_round_trips_s(echo.address, c, max(4, config.echo_calls // c))
        floors["echo_rtt_s"][str(c)] = describe(times)
        floors["sse"][str(c)] = await http_cell(f"http://{sse.address}/v1", "floor", c,
                                                config.cell, salt=c)
    group.stop(echo)
    group.stop(sse)
    return floors


def _router_args(pattern: str, engines: list[str], model: str) -> list[str]:
    roles = ("both", "both") if pattern == "round-robin" else ("prefill", "decode")
    flags = [f"--engine={address}={role}" for address, role in zip(engines, roles, strict=True)]
    return ["router", *flags, "--pattern", pattern, "--model", model, "--host", "127.0.0.1",
            "--port", "0", "--log-level", "WARNING"]


async def _start_stack(group: ServiceGroup, config: ControlPlaneConfig, pattern: str,
                       engines: list[str]) -> tuple[ServiceProcess, ServiceProcess]:
    router = group.start(f"router-{pattern}", _router_args(pattern, engines, config.model))
    await wait_grpc_serving(router.address, config.startup_timeout_s)
    gateway = group.start(f"gateway-{pattern}", ["gateway", "--router", router.address,
                                                 "--host", "127.0.0.1", "--port", "0",
                                                 "--log-level", "warning"])
    await wait_http_ready(f"http://{gateway.address}/health", config.startup_timeout_s)
    return router, gateway


async def measure_pattern(group: ServiceGroup, config: ControlPlaneConfig, pattern: str,
                          engines: list[str], failures: list[str]) -> list[dict[str, Any]]:
    """Cells of one pattern; when its router or gateway fails to start, the direct depth is
    still measured and the failure is recorded."""
    stack: tuple[ServiceProcess, ServiceProcess] | None = None
    try:
        stack = await _start_stack(group, config, pattern, engines)
    except (RuntimeError, TimeoutError) as exc:
        failures.append(f"{pattern}: {exc}"[:3000])
        group.close_matching(f"-{pattern}")
    addresses = [*engines, *([stack[0].address] if stack else [])]
    channels = [create_channel(address, TransportSettings()) for address in addresses]
    cells: list[dict[str, Any]] = []
    try:
        stubs = [cast("engine_pb2_grpc.EngineAsyncStub", engine_pb2_grpc.EngineStub(ch))
                 for ch in channels[:2]]
        flow = (DirectFlow(engines=stubs) if pattern == "round-robin"
                else DirectFlow(engines=[stubs[1]], prefill=stubs[0]))
        router_stub = (cast("router_pb2_grpc.RouterAsyncStub", router_pb2_grpc.RouterStub(channels[2]))
                       if stack else None)

        async def direct(ids: list[int], n: int, i: int, record: Any, origin: float) -> None:
            await run_direct(flow, ids, n, i, record, origin)

        async def via_router(ids: list[int], n: int, i: int, record: Any, origin: float) -> None:
            assert router_stub is not None  # only called when the stack started
            await run_router(router_stub, ids, n, record, origin)

        runs = {"direct": direct, "router": via_router, "gateway": None}
        depths = list(runs) if stack is not None else ["direct"]
        for c in config.concurrencies:
            salt = zlib.crc32(f"{pattern}/{c}".encode()) & 0xFFFF
            for round_ in range(config.rounds):
                # Depths interleaved, in a rotated order each round, so a change in the
                # machine's background load spreads over all of them.
                for depth in depths[round_ % len(depths):] + depths[: round_ % len(depths)]:
                    run = runs[depth]
                    if run is None:
                        assert stack is not None  # the gateway depth exists only with a stack
                        summary = await http_cell(f"http://{stack[1].address}/v1", "", c,
                                                  config.cell, salt + round_)
                    else:
                        summary = await grpc_cell(run, c, config.cell, salt + round_)
                    cells.append(_cell(pattern, depth, c, summary, flow.num_engine_calls))
            print(f"  {pattern} @ {c}: done", flush=True)
    finally:
        for channel in channels:
            await channel.close(None)
        if stack is not None:
            group.stop(stack[1])
            group.stop(stack[0])
    return cells


def _cell(pattern: str, depth: str, c: int, summary: dict[str, Any], calls: int) -> dict[str, Any]:
    return {"pattern": pattern, "depth": depth, "concurrency": c, "num_engine_calls": calls,
            "summary": summary}


async def run_control_plane(config: ControlPlaneConfig, log_dir: Path) -> dict[str, Any]:
    with service_group(log_dir) as group:
        floors = await measure_floors(group, config)
        shims = [group.start(f"shim-{i}", _shim_args(config), timeout_s=config.startup_timeout_s)
                 for i in range(2)]
        engines = [s.address for s in shims]
        await asyncio.gather(*(wait_grpc_serving(a, config.startup_timeout_s) for a in engines))
        cells: list[dict[str, Any]] = []
        failures: list[str] = []
        for pattern in config.patterns:
            cells += await measure_pattern(group, config, pattern, engines, failures)
    return {"config": asdict(config), "floors": floors, "cells": cells, "failures": failures}


def parse_args(argv: list[str]) -> tuple[ControlPlaneConfig, Path]:
    p = argparse.ArgumentParser(prog="microserving bench control-plane", allow_abbrev=False,
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="engine model preset or directory")
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 64, 256])
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every cell, depths interleaved; tables show medians")
    p.add_argument("--shim-arg", action="append", default=[], help="extra flag for each shim")
    p.add_argument("--out", type=Path, required=True, help="directory for JSON, table and plot")
    args = p.parse_args(argv)
    cell = CellShape(args.prompt_len, args.output_len, args.requests_per_stream, args.min_requests)
    config = ControlPlaneConfig(model=args.model, patterns=tuple(args.patterns),
                                concurrencies=tuple(args.concurrency), cell=cell,
                                shim_args=tuple(args.shim_arg), rounds=args.rounds)
    return config, args.out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    config, out = parse_args(args)
    out.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run_control_plane(config, out / "logs"))
    result["machine"] = machine_info(["microserving", "bench", "control-plane", *args])
    (out / "control_plane.json").write_text(json.dumps(result, indent=1) + "\n")
    table = report(result, out)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
