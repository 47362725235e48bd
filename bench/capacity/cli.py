"""`microserving bench capacity --out DIR`: how much of a GPU engine's token rate the control
plane relays, measured on a CPU machine.

Starts gateway + router + synthetic shims (a BENCHMARK-ONLY backend that keeps a measured GPU
step-time schedule) as real processes, drives round-robin (one engine) and disagg (1P:1D) with
closed-loop streams through the gateway's OpenAI API, and writes DIR/capacity.json plus a
table at the end (and each cell to DIR/cells.jsonl as it ends): client tok/s against what
the schedule allows, the first-token time added over the schedule's own, ITL p99, and each
process's CPU ms per 1,000 relayed tokens (from /proc; the synthetic engine thread, which
stands for the GPU engine, taken out).

    microserving bench capacity --out runs/capacity
    microserving bench capacity --toy --out /tmp/cap         # seconds, for CI
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import signal
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.capacity import profiling
from bench.capacity.cell import measure_cell
from bench.capacity.client import LoadSpec
from bench.capacity.client_processes import ClientProcesses
from bench.capacity.engine_alone import AloneResult, EngineAlone
from bench.capacity.nominal import Nominal, nominal
from bench.capacity.profiling import start_profiles
from bench.capacity.report import fold_rounds, table
from bench.capacity.stack import ROLES, Stack, StackOptions, start_stack
from bench.loadgen.results import host_speed, machine_info, speed_text
from bench.procs import ServiceGroup, service_group
from engine_shim.backends.synthetic.profile import (
    DEFAULT_PREFILL_TOK_S,
    DEFAULT_STEP_MS,
    StepProfile,
)

_SETTLE_S = 1.0  # after a timed cell cuts its streams off, let the stack abort them


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="microserving bench capacity", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for capacity.json and logs")
    p.add_argument("--patterns", nargs="+", choices=tuple(ROLES), default=list(ROLES))
    p.add_argument("--streams", nargs="+", type=int, default=[1, 32, 64, 128],
                   help="closed-loop stream counts")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (token ids)")
    p.add_argument("--output-len", type=int, default=256, help="tokens per request (ignore_eos)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--duration-s", type=float, help="measured window per cell (default 10)")
    load.add_argument("--requests", type=int,
                      help="requests per cell instead of a window: every token counts")
    load.add_argument("--requests-per-stream", type=int,
                      help="like --requests, streams x this many requests per cell")
    p.add_argument("--min-requests", type=int, default=0,
                   help="with --requests-per-stream: at least this many requests per cell (one "
                        "stream's first-token median then rests on more than a handful)")
    p.add_argument("--warmup-s", type=float, default=3.0, help="timed cells: load before the window")
    p.add_argument("--rounds", type=int, default=1, help="rounds per cell (median and spread)")
    p.add_argument("--step-ms", default=DEFAULT_STEP_MS,
                   help="synthetic decode step ms by batch (default: llama-1b on one H200)")
    p.add_argument("--prefill-tok-s", type=float, default=DEFAULT_PREFILL_TOK_S)
    p.add_argument("--gateway-workers", type=int, default=1, help="the gateway's --workers")
    p.add_argument("--router-replicas", type=int, default=1,
                   help="router processes over the same engines, all given to the gateway")
    p.add_argument("--client-processes", type=int, nargs="+", default=[1],
                   help="the closed loop's streams dealt over this many client processes "
                        "(default 1: one asyncio client sends every request and reads every "
                        "chunk; on a host with cores to spare, several keep the client's own "
                        "turnaround out of the figures); several counts take turns on the "
                        "same stack each round, a row each")
    p.add_argument("--ab-env", metavar="NAME",
                   help="side by side over an environment variable of every stack process "
                        "(not the engine alone): each round runs each --ab-values value on a "
                        "stack started with it, in the other order each round, a row each")
    p.add_argument("--ab-values", nargs="+", metavar="VALUE", default=[],
                   help="the values of --ab-env")
    p.add_argument("--alone-each-round", action="store_true",
                   help="--backend embedded: keep the engine alone loaded beside the stacks and "
                        "run it again right before each round's cells of a stream count, their "
                        "yardstick (a device whose speed drifts over a run then moves both "
                        "sides of a ratio alike; needs memory for one more engine)")
    p.add_argument("--embed-router", action="store_true",
                   help="the router inside the gateway's process(es) (`microserving serve`), "
                        "no router process")
    p.add_argument("--backend", choices=["synthetic", "embedded"], default="synthetic",
                   help="the shims' engine: the synthetic schedule (default) or the real embedded "
                        "engine, then measured against itself alone in-process (needs --requests or "
                        "--requests-per-stream)")
    p.add_argument("--model", default="tiny", help="embedded backend: model preset or directory")
    p.add_argument("--device", default="cpu", help="embedded backend: cpu, cuda or cuda:N")
    p.add_argument("--shim-arg", action="append", default=[],
                   help="extra argument for every shim, e.g. --shim-arg=--stream-updates-per-s=0")
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra argument for every router process, e.g. --router-arg=--log-level=INFO "
                        "(the router's retries are logged at INFO)")
    p.add_argument("--profile-s", type=float, default=0.0,
                   help="py-spy every control-plane process this long during the first round "
                        "of the largest stream count (raw profiles in --out), and the engine "
                        "alone's staggered run at that count")
    p.add_argument("--py-spy-arg", action="append", default=[],
                   help="extra argument for py-spy record with --profile-s, e.g. "
                        "--py-spy-arg=--idle or --py-spy-arg=--native")
    p.add_argument("--stagger-ms", type=float, default=0.0,
                   help="the stack's streams start this far apart (0: all at once), as the "
                        "engine alone's staggered run starts them one step apart: the load "
                        "then does not run in waves")
    p.add_argument("--toy", action="store_true",
                   help="a seconds-long run for CI: streams 1 4, 8 requests of 32+16 tokens")
    return p


def _load_specs(args: argparse.Namespace) -> tuple[list[int], LoadSpec]:
    if args.toy:
        args.streams, args.input_len, args.output_len = [1, 4], 32, 16
        args.requests = args.requests or 8
    spec = LoadSpec(base_url="", model=args.model, streams=1, input_len=args.input_len,
                    output_len=args.output_len, count_usage=args.backend != "synthetic",
                    stagger_s=args.stagger_ms / 1e3)
    if args.requests is not None:
        return args.streams, replace(spec, num_requests=args.requests)
    if args.requests_per_stream is not None:
        return args.streams, replace(spec, num_requests=args.requests_per_stream)
    return args.streams, replace(spec, warmup_s=args.warmup_s, duration_s=args.duration_s or 10.0)


def _stack_options(args: argparse.Namespace, max_streams: int) -> StackOptions:
    return StackOptions(step_ms=args.step_ms, prefill_tok_s=args.prefill_tok_s,
                        max_num_seqs=max(256, max_streams), gateway_workers=args.gateway_workers,
                        router_replicas=args.router_replicas, shim_args=tuple(args.shim_arg),
                        router_args=tuple(args.router_arg),
                        embed_router=args.embed_router,
                        backend=args.backend, model=args.model, device=args.device,
                        startup_timeout_s=600.0 if args.backend != "synthetic" else 120.0)


def _num_requests(args: argparse.Namespace, spec: LoadSpec, streams: int) -> int | None:
    """A cell's request count (None: a timed cell)."""
    if args.requests_per_stream is not None:
        return max(args.requests_per_stream * streams, args.min_requests)
    return spec.num_requests


def _engine_alone(args: argparse.Namespace, streams_list: list[int], spec: LoadSpec,
                  alone: EngineAlone) -> dict[tuple[int, bool], AloneResult]:
    """The real engine alone (in a process of its own), each stream count on the same
    workload, before any shim takes the device: streams started at once (the yardstick of the
    ratio) and staggered one step apart (EngineAlone.run), keyed (streams, staggered). With
    --alone-each-round the yardstick is run before each round's cells instead, so this pass
    runs only the staggered variant, once: on a GPU lent by the minute it was a third of a
    call (two rounds of both variants of every stream count, before any stack)."""
    results = {}
    each_round = args.alone_each_round
    variants = (True,) if each_round else (False, True)
    for streams in streams_list:
        runs: dict[bool, list[AloneResult]] = {staggered: [] for staggered in variants}
        for round_index in range(1 if each_round else args.rounds):
            for staggered in variants:
                profiler = None if not (args.profile_s and staggered and round_index == 0
                                        and streams == max(streams_list)) else \
                    profiling.record(alone.pid, args.out / f"profile-alone-{streams}.txt",
                                     args.profile_s, args.py_spy_arg)
                result = alone.run(streams, spec.input_len, spec.output_len,
                                   _num_requests(args, spec, streams) or 8 * streams,
                                   seed=round_index * 1000 + streams, staggered=staggered)
                print(f"  engine alone streams {streams:>4} round {round_index}"
                      f"{' staggered' if staggered else ''}: {result.tok_s:,.0f} tok/s, "
                      f"TTFT p50 {result.ttft_p50_s * 1e3:.2f} ms, {_steps_text(result.engine_steps)}",
                      file=sys.stderr, flush=True)
                runs[staggered].append(result)
                if profiler is not None:  # py-spy writes what it has on SIGINT
                    profiler.send_signal(signal.SIGINT)
                    profiler.wait()
        for staggered, found in runs.items():  # the median round of each
            results[(streams, staggered)] = sorted(found, key=lambda r: r.tok_s)[len(found) // 2]
    return results


def _alone_now(engine: EngineAlone, args: argparse.Namespace, spec: LoadSpec, streams: int,
               round_index: int) -> AloneResult:
    """--alone-each-round: the engine alone at `streams` once more, right before the stack's
    cells of this round, their yardstick."""
    result = engine.run(streams, spec.input_len, spec.output_len,
                        _num_requests(args, spec, streams) or 8 * streams,
                        seed=round_index * 1000 + streams)
    print(f"  engine alone streams {streams:>4} round {round_index} (this round's yardstick): "
          f"{result.tok_s:,.0f} tok/s, TTFT p50 {result.ttft_p50_s * 1e3:.2f} ms",
          file=sys.stderr, flush=True)
    return result


async def _measure(stack: Stack, spec: LoadSpec, schedule: Nominal,
                   client_processes: int) -> dict[str, Any]:
    """One cell, its load from this process or dealt over `client_processes` processes."""
    if client_processes == 1:
        return await measure_cell(stack, spec, schedule)
    client = ClientProcesses(client_processes)
    return await measure_cell(stack, spec, schedule, client, client.cpu_s)


def _turns(items: list[Any], round_index: int) -> list[Any]:
    """Variants that take turns in a round: in the other order each round, so that none
    always comes first."""
    return items if round_index % 2 == 0 else items[::-1]


async def _pattern_rows(group: ServiceGroup, pattern: str, args: argparse.Namespace,
                        options: StackOptions, base_spec: LoadSpec, profile: StepProfile,
                        alone: dict[tuple[int, bool], AloneResult] | None,
                        engine: EngineAlone | None) -> list[dict[str, Any]]:
    """Every round of one pattern: per round, each --ab-values value on a stack started
    with it (the one stack for all rounds without --ab-env), each stream count, each client
    process count; a row per (streams, client processes, value), its rounds folded. With
    `engine` (--alone-each-round) each round's cells of a stream count are measured against
    the engine alone run right before them, not against the runs before every stack."""
    streams_list, clients = args.streams, args.client_processes
    values: list[str | None] = list(args.ab_values) if args.ab_env else [None]
    rounds: dict[tuple[int, int, str | None], list[dict[str, Any]]] = {
        (s, c, v): [] for s in streams_list for c in clients for v in values}
    stack: Stack | None = None
    for round_index in range(args.rounds):
        for value in _turns(values, round_index):
            if stack is None:
                stack = await start_stack(group, pattern, options if value is None else replace(
                    options, env=((args.ab_env, value),), label=f"-{_label(value)}-r{round_index}"))
            for streams in streams_list:
                now = None if engine is None else _alone_now(engine, args, base_spec, streams, round_index)
                for client_processes in _turns(clients, round_index):
                    spec = replace(base_spec, base_url=stack.base_url, streams=streams,
                                   seed=round_index * 1000 + streams,
                                   num_requests=_num_requests(args, base_spec, streams))
                    schedule = (nominal(pattern, streams, profile, spec.input_len, spec.output_len)
                                if alone is None else (now or alone[(streams, False)]).as_nominal())
                    profiles = [] if not (args.profile_s and round_index == 0 and
                                          streams == max(streams_list) and
                                          client_processes == clients[0] and value == values[0]) else \
                        start_profiles(stack, args.out, f"{pattern}-{streams}", args.profile_s,
                                       args.py_spy_arg)
                    cell = await _measure(stack, spec, schedule, client_processes)
                    for profiler in profiles:
                        await asyncio.to_thread(profiler.wait)
                    rounds[(streams, client_processes, value)].append(cell)
                    _progress(pattern, streams, round_index, cell, client_processes, value)
                    _keep_cell(args.out, pattern, streams, round_index, cell, client_processes, value)
                    if spec.duration_s is not None:
                        await asyncio.sleep(_SETTLE_S)
            if value is not None:  # the next value gets a stack of its own
                group.close()
                stack = None
    group.close()
    rows = []
    for (streams, client_processes, value), cells in rounds.items():
        row = _with_staggered(fold_rounds(pattern, streams, cells), alone)
        row["client_processes"] = client_processes
        if value is not None:
            row["ab"] = {"env": args.ab_env, "value": value}
        rows.append(row)
    return rows


async def run(args: argparse.Namespace) -> dict[str, Any]:
    profile = StepProfile.parse(args.step_ms, args.prefill_tok_s)
    # The host's part of every hop, printed first: it stays in the log of a run cut short
    # (the JSON's machine line is measured again at the end).
    print(f"host at the start: {speed_text(host_speed())}", flush=True)
    streams_list, base_spec = _load_specs(args)
    options = _stack_options(args, max(streams_list))
    engine = None if args.backend == "synthetic" else \
        EngineAlone(args.model, args.device, options.max_num_seqs, {})
    rows: list[dict[str, Any]] = []
    try:
        alone = None if engine is None else _engine_alone(args, streams_list, base_spec, engine)
        if engine is not None and not args.alone_each_round:
            engine.close()  # the device is the stacks' from here
            engine = None
        with service_group(args.out / "logs") as group:
            for pattern in args.patterns:
                rows += await _pattern_rows(group, pattern, args, options, base_spec, profile,
                                            alone, engine)
    finally:
        if engine is not None:
            engine.close()
    return {
        "benchmark": "capacity",
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "load": asdict(base_spec)},
        "profile": {"step_ms": args.step_ms, "prefill_tok_s": args.prefill_tok_s},
        "machine": machine_info(["microserving", "bench", "capacity", *sys.argv[2:]]),
        "rows": rows,
        "engine_alone": None if alone is None else [asdict(r) for r in alone.values()],
    }


def _with_staggered(row: dict[str, Any],
                    alone: dict[tuple[int, bool], AloneResult] | None) -> dict[str, Any]:
    """The row against the engine alone with staggered arrivals too (EngineAlone.run)."""
    if alone is not None:
        staggered = alone[(row["streams"], True)].tok_s
        row["alone_staggered_tok_s"] = staggered
        row["ratio_vs_staggered"] = row["client_tok_s"] / staggered if staggered else None
    return row


def _label(value: str) -> str:
    """An --ab-values value as part of a log file's name: as it is where it can be, else with
    a path's separators and the like made '_' and a digest of the value after it (two values
    never share a name)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", value).strip("._")
    if safe == value:
        return value
    return f"{safe}-{hashlib.sha1(value.encode()).hexdigest()[:8]}"


def _progress(pattern: str, streams: int, round_index: int, cell: dict[str, Any],
              client_processes: int = 1, value: str | None = None) -> None:
    """One line a cell as it ends, with the figures a run cut short would otherwise lose (the
    table and the JSON are written at the end): tokens/s, ratio, added first token, CPU."""
    clients = "" if client_processes == 1 else f" ({client_processes} client processes)"
    clients += "" if value is None else f" [{value}]"
    added = cell.get("ttft_added_p50_ms")
    first = "" if added is None else f"first token {added:+.2f} ms, "
    print(f"  {pattern:<12} streams {streams:>4} round {round_index}{clients}: "
          f"{cell['client_tok_s']:,.0f} tok/s (ratio {cell['ratio']:.2f}), {first}"
          f"CPU {cell['cpu_ms_per_1k_tokens']['total'] or 0:.1f} ms per 1k tokens, "
          f"{cell['num_errors']} errors", file=sys.stderr, flush=True)
    for name, steps in (cell.get("engine_steps") or {}).items():
        print(f"    {name}: {_steps_text(steps)}", file=sys.stderr, flush=True)
    others = cell.get("other_processes") or []
    if others or cell["other_busy_cores"] >= 0.1:  # busy cores outside the stack and client
        busiest = ", ".join(f"{o['name']} {o['cores']:.2f}" for o in others) or "no process"
        print(f"    outside the stack and the client: {cell['other_busy_cores']:.2f} cores "
              f"(interrupts {cell['irq_cores']:.2f}; {busiest})", file=sys.stderr, flush=True)


def _keep_cell(out: Path, pattern: str, streams: int, round_index: int, cell: dict[str, Any],
               client_processes: int, value: str | None) -> None:
    """Append the cell to DIR/cells.jsonl as it ends: capacity.json and the table come only
    at the end of the run, and a run cut short (a device call's time limit) keeps every cell
    it finished."""
    entry = {"pattern": pattern, "streams": streams, "round": round_index,
             "client_processes": client_processes, "ab_value": value, **cell}
    with (out / "cells.jsonl").open("a", encoding="utf-8") as cells:
        cells.write(json.dumps(entry) + "\n")


def _steps_text(steps: dict[str, Any] | None) -> str:
    if not steps or not steps.get("steps"):
        return "no engine steps"
    idle = f" ({steps['idle_ms_per_step']:.2f} idle)" if "idle_ms_per_step" in steps else ""
    return (f"{steps['tokens_per_step']:.1f} tokens a step, {steps['step_ms']:.2f} ms in a step, "
            f"{steps['loop_ms_per_step']:.2f} ms a loop turn{idle}")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (min(args.rounds, args.gateway_workers, args.router_replicas, *args.client_processes,
            *args.streams, args.output_len) < 1 or args.input_len < 2):
        parser.error("--rounds, --streams, --output-len, --gateway-workers, --router-replicas and "
                     "--client-processes must be >= 1, --input-len >= 2")
    if args.alone_each_round and args.backend == "synthetic":
        parser.error("--alone-each-round measures the embedded engine alone: with --backend embedded")
    if bool(args.ab_env) != bool(args.ab_values):
        parser.error("--ab-env and --ab-values go together")
    if args.embed_router and args.router_replicas != 1:
        parser.error("--embed-router runs a router in each gateway worker: no --router-replicas")
    if args.backend != "synthetic" and args.requests is None and args.requests_per_stream is None:
        parser.error("--backend embedded counts tokens from usage: give --requests or "
                     "--requests-per-stream")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cells.jsonl").unlink(missing_ok=True)  # this run's cells only
    try:
        result = asyncio.run(run(args))
    except (RuntimeError, TimeoutError, ValueError) as error:
        print(f"microserving bench capacity: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    path = args.out / "capacity.json"
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (args.out / "table.md").write_text(table(result["rows"]) + "\n", encoding="utf-8")
    print(table(result["rows"]))
    print(f"CPU columns: ms per 1,000 relayed tokens (shims without their engine thread). "
          f"results: {path}")
    return 0
