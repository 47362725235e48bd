"""The capacity benchmark's closed loop split over several client processes.

One asyncio client relays every stream's SSE chunks and sends every next request on one
core. Where the streams end together (every request has the same output length), it then
sends a whole wave of requests one after another, and the last of them leaves that much
later: the client's own turnaround, which the engine alone measured in-process never pays.
With `--client-processes N` the streams are dealt over N spawned processes (each the same
`run_load`), started at one shared perf_counter origin (CLOCK_MONOTONIC, the same in every
process of the machine), so the window and every record keep one clock. The client's CPU is
the parent's and its children's, read from /proc at the window's edges like the stack's.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection

from bench.capacity.client import LoadResult, LoadSpec, StreamRecord, run_load
from bench.capacity.cpu import process_cpu_s

# Every child has its session before the origin is set; this much ahead of "now" when it is
# sent, so that each has read it before the origin comes (a child that reads it late starts
# late, on the same clock).
_ORIGIN_LEAD_S = 0.005
_READY_TIMEOUT_S = 60.0


def deal(total: int, parts: int) -> list[int]:
    """`total` dealt over `parts` as evenly as whole numbers allow, larger shares first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def shares(spec: LoadSpec, processes: int) -> list[LoadSpec]:
    """Each process's part of the load: its streams, its share of a fixed request count (in
    proportion to its streams), its own seed. At most one process a stream."""
    streams = deal(spec.streams, min(processes, spec.streams))
    if spec.num_requests is None:
        requests: list[int | None] = [None] * len(streams)
    else:
        # In proportion to the streams, the remainder to the first: the counts add up.
        base = [spec.num_requests * s // spec.streams for s in streams]
        extra = deal(spec.num_requests - sum(base), len(streams))
        requests = [b + e for b, e in zip(base, extra, strict=True)]
    return [replace(spec, streams=s, num_requests=r, seed=spec.seed * 1000 + i)
            for i, (s, r) in enumerate(zip(streams, requests, strict=True))]


def _child(spec: LoadSpec, conn: Connection) -> None:
    """A client process: its session up, "ready"; then the shared origin; its records back;
    it stays until told to go, so its CPU can still be read at the window's close."""

    async def starting() -> float:
        conn.send("ready")
        return float(await asyncio.to_thread(conn.recv))

    result = asyncio.run(run_load(spec, starting=starting))
    conn.send(result.records)
    conn.recv()


class ClientProcesses:
    """`run_load` over `processes` spawned processes, a drop-in `Load` for measure_cell."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._pids: list[int] = []

    def cpu_s(self) -> float:
        """This process's CPU and every live child's."""
        return time.process_time() + sum(process_cpu_s(pid) for pid in self._pids)

    async def __call__(self, spec: LoadSpec, at_edge: Callable[[str], None]) -> LoadResult:
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        parts = shares(spec, self.processes)
        pipes = [context.Pipe() for _ in parts]
        children = [context.Process(target=_child, args=(part, child_end), daemon=True)
                    for part, (_, child_end) in zip(parts, pipes, strict=True)]
        for child in children:
            child.start()
        self._pids = [child.pid for child in children if child.pid is not None]
        try:
            for parent_end, _ in pipes:
                if not await asyncio.to_thread(parent_end.poll, _READY_TIMEOUT_S):
                    raise RuntimeError("a client process did not start")
                parent_end.recv()
            timed = spec.duration_s is not None
            if not timed:  # the window is the whole load: open it before any request goes
                at_edge("open")
            origin_s = time.perf_counter() + _ORIGIN_LEAD_S
            for parent_end, _ in pipes:
                parent_end.send(origin_s)

            async def until(t_s: float) -> None:
                await asyncio.sleep(max(0.0, origin_s + t_s - time.perf_counter()))

            if timed:
                await until(spec.warmup_s)
                at_edge("open")
                await until(spec.warmup_s + (spec.duration_s or 0.0))
                at_edge("close")
            records: list[StreamRecord] = []
            for parent_end, _ in pipes:
                try:
                    records += await asyncio.to_thread(parent_end.recv)
                except EOFError as error:
                    raise RuntimeError("a client process ended without its records") from error
            span_s = spec.duration_s if timed and spec.duration_s else time.perf_counter() - origin_s
            if not timed:
                at_edge("close")
            return LoadResult(records, span_s)
        finally:
            for parent_end, _ in pipes:
                with contextlib.suppress(OSError):  # a child already gone
                    parent_end.send("bye")
            for child in children:
                await asyncio.to_thread(child.join, 10.0)
                if child.is_alive():
                    child.kill()
            self._pids = []
