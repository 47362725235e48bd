"""`microserving bench mlc-relay --out DIR`: does `shim --backend mlc` + the router keep up with
MLC-compatible engines? Side by side in one run, on the same `microserving mlc-compat` engine
processes (BENCHMARK-ONLY synthetic core: tokens on a GPU step-time schedule, so the engine is
not a CPU-bound tiny model), per stream count and round:

  direct  an HTTP client streaming /v1/completions from the engine (what MLC users get; disagg:
          the client makes MLC's own router calls, prep_recv -> remote_send -> start_generate)
  relay   the same closed-loop workload as Router.GenerateBatched requests (the gateway's
          RouterClient) -> router -> shim --backend mlc -> the same engine(s); with
          --in-process-router the router runs in this process (`microserving serve`'s
          topology), its CPU in the client's column

It writes DIR/mlc_relay.json and prints a table: tok/s of each and relay/direct, TTFT p50 of
each and the relay's added first-token time in raw round trips (an HTTP GET to the engine, a
gRPC health check to the router), and CPU ms per 1,000 tokens of each process (/proc; the
engine's own thread, the stand-in for the GPU, taken out).

    microserving bench mlc-relay --out runs/mlc-relay --rounds 3
    microserving bench mlc-relay --toy --out /tmp/relay      # seconds, for CI
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.capacity.cell import Load, measure_cell
from bench.capacity.client import LoadSpec
from bench.capacity.nominal import nominal
from bench.capacity.profiling import start_profiles
from bench.capacity.report import fold_rounds
from bench.loadgen.results import machine_info
from bench.mlc_relay_load import (
    direct_load,
    in_process_relay_load,
    mlc_body,
    relay_load,
    round_trips,
)
from bench.mlc_relay_report import compare_rows, table
from bench.mlc_relay_stack import ROLES, RelayStack, start_relay_stack
from bench.procs import service_group
from engine_shim.backends.synthetic.profile import (
    DEFAULT_PREFILL_TOK_S,
    DEFAULT_STEP_MS,
    StepProfile,
)

PATTERNS = tuple(ROLES)
_SETTLE_S = 1.0  # after a timed cell cuts its streams off, let the engines abort them


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="microserving bench mlc-relay", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for mlc_relay.json and logs")
    p.add_argument("--patterns", nargs="+", choices=PATTERNS, default=list(PATTERNS))
    p.add_argument("--streams", nargs="+", type=int, default=[1, 32, 128],
                   help="closed-loop stream counts")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (token ids)")
    p.add_argument("--output-len", type=int, default=256, help="tokens per request (ignore_eos)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--duration-s", type=float, help="measured window per cell (default 10)")
    load.add_argument("--requests", type=int,
                      help="requests per cell instead of a window: every token counts")
    p.add_argument("--warmup-s", type=float, default=3.0, help="timed cells: load before the window")
    p.add_argument("--rounds", type=int, default=3, help="rounds per cell (median and spread)")
    p.add_argument("--step-ms", default=DEFAULT_STEP_MS,
                   help="synthetic decode step ms by batch (default: llama-1b on one H200)")
    p.add_argument("--prefill-tok-s", type=float, default=DEFAULT_PREFILL_TOK_S)
    p.add_argument("--in-process-router", action="store_true",
                   help="the relay's router in the benchmark's own process (router/inprocess.py, "
                        "as `microserving serve` runs it): its CPU counts in the client's")
    p.add_argument("--shim-arg", action="append", default=[],
                   help="extra argument for every shim, e.g. --shim-arg=--log-level=INFO")
    p.add_argument("--profile-s", type=float, default=0.0,
                   help="py-spy every process of the relay side this long during the first round "
                        "of the largest stream count (raw profiles in --out)")
    p.add_argument("--toy", action="store_true",
                   help="a seconds-long run for CI: streams 1 4, 8 requests of 32+16 tokens, 1 round")
    return p


def _base_spec(args: argparse.Namespace) -> LoadSpec:
    if args.toy:
        args.streams, args.input_len, args.output_len = [1, 4], 32, 16
        args.requests, args.rounds = args.requests or 8, 1
    spec = LoadSpec(base_url="", model="tiny", streams=1, input_len=args.input_len,
                    output_len=args.output_len)
    if args.requests is not None:
        return replace(spec, num_requests=args.requests)
    return replace(spec, warmup_s=args.warmup_s, duration_s=args.duration_s or 10.0)


async def _measure_pattern(args: argparse.Namespace, stack: RelayStack, base: LoadSpec,
                           profile: StepProfile) -> list[dict[str, Any]]:
    sides: dict[str, tuple[Any, Load]] = {
        "direct": (stack.direct_view(), direct_load(stack.disagg)),
        "relay": (stack.relay_view(), in_process_relay_load(stack.engine_addresses, stack.pattern)
                  if args.in_process_router else relay_load(stack.router_address)),
    }
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for round_index in range(args.rounds):
        for streams in args.streams:
            spec = replace(mlc_body(base), base_url=stack.direct_base_url, streams=streams,
                           seed=round_index * 1000 + streams)
            schedule = nominal(stack.pattern, streams, profile, spec.input_len, spec.output_len)
            # Alternate which side goes first, so neither always meets a freshly idle machine.
            order = ("direct", "relay") if round_index % 2 == 0 else ("relay", "direct")
            for side in order:
                view, load = sides[side]
                profiles = [] if not (args.profile_s and side == "relay" and round_index == 0
                                      and streams == max(args.streams)) else \
                    start_profiles(view, args.out, f"{stack.pattern}-{streams}", args.profile_s)
                cell = await measure_cell(view, spec, schedule, load)
                for profiler in profiles:
                    await asyncio.to_thread(profiler.wait)
                cells.setdefault((side, streams), []).append(cell)
                _progress(stack.pattern, side, streams, round_index, cell)
                if spec.duration_s is not None:
                    await asyncio.sleep(_SETTLE_S)
    return [fold_rounds(f"{stack.pattern}/{side}", streams, rounds)
            for (side, streams), rounds in cells.items()]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    profile = StepProfile.parse(args.step_ms, args.prefill_tok_s)
    base = _base_spec(args)
    rows: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []
    with service_group(args.out / "logs") as group:
        for pattern in args.patterns:
            stack = await start_relay_stack(group, pattern, args.step_ms, args.prefill_tok_s,
                                            max(256, *args.streams), tuple(args.shim_arg))
            trips = await round_trips(stack.engine_url, stack.router_address)
            pattern_rows = await _measure_pattern(args, stack, base, profile)
            rows += pattern_rows
            comparisons += compare_rows(pattern, pattern_rows, trips)
            group.close()
    return {
        "benchmark": "mlc-relay",
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "load": asdict(base)},
        "profile": {"step_ms": args.step_ms, "prefill_tok_s": args.prefill_tok_s},
        "machine": machine_info(["microserving", "bench", "mlc-relay", *args.argv]),
        "comparisons": comparisons,
        "rows": rows,
    }


def _progress(pattern: str, side: str, streams: int, round_index: int, cell: dict[str, Any]) -> None:
    print(f"  {pattern:<12} {side:<6} streams {streams:>4} round {round_index}: "
          f"{cell['client_tok_s']:,.0f} tok/s, TTFT p50 {cell['ttft_p50_ms'] or 0:.2f} ms, "
          f"busy cores {cell['machine_busy_cores']:.2f}, {cell['num_errors']} errors",
          file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv)
    if min(args.rounds, *args.streams, args.output_len) < 1 or args.input_len < 2:
        parser.error("--rounds, --streams and --output-len must be >= 1, --input-len >= 2")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        result = asyncio.run(run(args))
    except (RuntimeError, TimeoutError, ValueError) as error:
        print(f"microserving bench mlc-relay: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    path = args.out / "mlc_relay.json"
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (args.out / "table.md").write_text(table(result["comparisons"]) + "\n", encoding="utf-8")
    print(table(result["comparisons"]))
    print(f"CPU columns: ms per 1,000 tokens (the engine without its engine thread). "
          f"results: {path}")
    return 0
