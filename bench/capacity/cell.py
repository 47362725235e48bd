"""One measured cell (pattern x streams x round): the load, the CPU counters at the window's
edges, and the figures derived from them."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bench.capacity import engine_steps
from bench.capacity.client import LoadResult, LoadSpec, run_load
from bench.capacity.cpu import (
    ProcessCpu,
    busiest_others,
    machine_busy_s,
    machine_irq_s,
    processes_cpu_s,
)
from bench.capacity.nominal import Nominal
from bench.capacity.router_metrics import Snapshot as RouterSnapshot
from bench.capacity.router_metrics import cell_summary, scrape
from bench.capacity.stack import Stack
from bench.loadgen.stats import percentile


@dataclass
class _Snapshot:
    wall_s: float
    processes: dict[str, tuple[float, float]]  # name -> (group CPU s, engine thread CPU s)
    machine_busy_s: float
    client_cpu_s: float
    routers: RouterSnapshot  # the routers' engine-call and first-token histograms, the gateway's
    engines: dict[str, engine_steps.Counters]  # each shim's engine steps, from its /metrics
    others: dict[int, ProcessCpu]  # every process's CPU, for the busiest outside the stack
    irq_s: float  # the machine's interrupt time (cpu.machine_irq_s)
    stack_groups: frozenset[int]  # the stack's process groups (and the load's own)


def _snapshot(stack: Stack, client_cpu_s: Callable[[], float]) -> _Snapshot:
    # The metrics last: a scrape takes a few ms, the counters above are the edge.
    gateway = [] if stack.gateway_metrics_port is None else [stack.gateway_metrics_port]
    return _Snapshot(time.perf_counter(), stack.cpu_s(), machine_busy_s(), client_cpu_s(),
                     scrape([*stack.router_metrics_ports, *gateway]),
                     engine_steps.scrape(stack.shim_metrics_ports), processes_cpu_s(),
                     machine_irq_s(), frozenset({*stack.process_groups(), os.getpgid(0)}))


# A closed-loop load: (spec, at_edge) -> its result; run_load is the gateway's HTTP client.
Load = Callable[[LoadSpec, Callable[[str], None]], Awaitable[LoadResult]]


async def measure_cell(
    stack: Stack, spec: LoadSpec, schedule: Nominal, load: Load = run_load,
    client_cpu_s: Callable[[], float] = time.process_time,
) -> dict[str, Any]:
    """`client_cpu_s`: the load's CPU seconds so far (this process's for `run_load`)."""
    edges: dict[str, _Snapshot] = {}

    def at_edge(edge: str) -> None:
        edges[edge] = _snapshot(stack, client_cpu_s)

    result = await load(spec, at_edge)
    return cell_figures(result, edges["open"], edges["close"], spec, schedule)


def _per_1k(cpu_s: float, num_tokens: int) -> float | None:
    """CPU milliseconds per 1,000 relayed tokens."""
    return None if num_tokens == 0 else cpu_s / num_tokens * 1e6


def cell_figures(
    result: LoadResult, opened: _Snapshot, closed: _Snapshot, spec: LoadSpec, schedule: Nominal
) -> dict[str, Any]:
    window_s = closed.wall_s - opened.wall_s
    records = result.records
    num_tokens = sum(r.num_tokens_in_window for r in records)
    num_chunks = sum(r.num_chunks_in_window for r in records)
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None and r.started_s >= spec.warmup_s]
    itls = [b - a for r in records for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:], strict=False)
            if a >= spec.warmup_s]
    # The first token to the second: disagg's hand-off from the prefill engine to the decoding
    # one (where P samples the first token) shows here, not in the first token.
    seconds = [r.chunk_times_s[1] - r.chunk_times_s[0] for r in records
               if len(r.chunk_times_s) > 1 and r.started_s >= spec.warmup_s]
    serving_s: dict[str, float] = {}
    engine_threads: dict[str, float | None] = {}
    cores: dict[str, float] = {}
    for name, (cpu_after, engine_after) in closed.processes.items():
        cpu_before, engine_before = opened.processes[name]
        engine_s = engine_after - engine_before
        # /proc counts in clock ticks (10 ms), the thread's and the group's rounded apart:
        # an idle process's difference can come out a tick below zero.
        serving_s[name] = max(0.0, cpu_after - cpu_before - engine_s)
        if name.startswith(("shim", "engine")):  # the processes that run an engine thread
            engine_threads[name] = _per_1k(engine_s, num_tokens)
        cores[name] = (cpu_after - cpu_before) / window_s
    client_tok_s = num_tokens / window_s
    machine_cores = (closed.machine_busy_s - opened.machine_busy_s) / window_s
    client_cores = (closed.client_cpu_s - opened.client_cpu_s) / window_s
    finished = [r.completion_tokens or 0 for r in records if r.finish_reason is not None]
    ttft_p50_s = percentile(ttfts, 50) if ttfts else None
    return {
        "nominal_tok_s": schedule.tok_s,
        "decode_tok_s": schedule.decode_tok_s,
        "client_tok_s": client_tok_s,
        "ratio": client_tok_s / schedule.tok_s,
        "schedule_ttft_ms": schedule.ttft_s * 1e3,
        "ttft_p50_ms": None if ttft_p50_s is None else ttft_p50_s * 1e3,
        # Beside the gateway's and the router's means (their histograms give exact means only).
        "ttft_mean_ms": sum(ttfts) / len(ttfts) * 1e3 if ttfts else None,
        "ttft_added_p50_ms": None if ttft_p50_s is None else (ttft_p50_s - schedule.ttft_s) * 1e3,
        "itl_p50_ms": percentile(itls, 50) * 1e3 if itls else None,
        "itl_p99_ms": percentile(itls, 99) * 1e3 if itls else None,
        "second_token_p50_ms": percentile(seconds, 50) * 1e3 if seconds else None,
        "second_token_p99_ms": percentile(seconds, 99) * 1e3 if seconds else None,
        # > 1 where a hop merged several tokens of a request into one SSE chunk.
        "tokens_per_chunk": num_tokens / num_chunks if num_chunks else None,
        # Serving CPU: each process group, its engine thread (a stand-in for the GPU
        # engine's own schedule) taken out of the shims.
        "cpu_ms_per_1k_tokens": {
            **{name: _per_1k(cpu_s, num_tokens) for name, cpu_s in serving_s.items()},
            "total": _per_1k(sum(serving_s.values()), num_tokens),
        },
        "engine_thread_ms_per_1k_tokens": engine_threads,
        "cpu_cores": cores,
        "client_cpu_ms_per_1k_tokens": _per_1k(closed.client_cpu_s - opened.client_cpu_s, num_tokens),
        "machine_busy_cores": machine_cores,
        # Busy cores that were neither the stack nor the client: other work on the machine,
        # the busiest processes of it, and the machine's interrupt time (machine_irq_s).
        "other_busy_cores": machine_cores - sum(cores.values()) - client_cores,
        "other_processes": busiest_others(opened.others, closed.others, window_s,
                                          set(closed.stack_groups)),
        "irq_cores": (closed.irq_s - opened.irq_s) / window_s,
        "load_avg_1m": os.getloadavg()[0],
        "window_s": window_s,
        "num_tokens": num_tokens,
        "num_requests_started": len(records),
        "num_requests_finished": sum(1 for r in records if r.finish_reason is not None),
        "completion_tokens_min": min(finished, default=None),
        "completion_tokens_max": max(finished, default=None),
        # PrepRecv / RemoteSend (with its KV push) as the routers timed them, and the router's
        # and the gateway's own first-token times (the hops below each).
        **cell_summary(opened.routers, closed.routers),
        "engine_steps": engine_steps.window(opened.engines, closed.engines, window_s),
        "errors": [r.error for r in records if r.error is not None][:10],
        "num_errors": sum(1 for r in records if r.error is not None),
    }

