"""A run's results as JSON: configuration, the machine it ran on, the summary and every
request's record (so later plots and comparisons need only the file)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.loadgen.client import RequestRecord

RESULTS_FILE = "results.json"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def host_speed(trials: int = 5) -> dict[str, float]:
    """How fast this host runs the stack's kind of work right now, so that figures taken on one
    VM on different days can be told apart (its speed moves with the host under it; one day's
    table ran at twice another's CPU per token with the same code): the median nanoseconds of
    one Python loop iteration and microseconds of a 64-byte round trip through a local socket
    pair (four syscalls), then the wake-ups (`wake_round_trips`). About 0.2 s."""
    loop_ns: list[float] = []
    trip_us: list[float] = []
    left, right = socket.socketpair()
    try:
        for _ in range(trials):
            start = time.perf_counter()
            total = 0
            for i in range(200_000):
                total += i
            loop_ns.append((time.perf_counter() - start) / 200_000 * 1e9)
            start = time.perf_counter()
            for _ in range(2_000):
                left.send(b"x" * 64)
                right.recv(64)
            trip_us.append((time.perf_counter() - start) / 2_000 * 1e6)
    finally:
        left.close()
        right.close()
    return {"python_loop_ns": round(statistics.median(loop_ns), 1),
            "socket_round_trip_us": round(statistics.median(trip_us), 2),
            **wake_round_trips()}


_WAKE_PAUSE_S = 0.002  # wake_round_trips' idle pause, which speed_text names


def wake_round_trips(busy: int = 300, idle: int = 40, pause_s: float = _WAKE_PAUSE_S) -> dict[str, float]:
    """Median microseconds of a one-byte round trip to a thread that waits for it in recv():
    back to back (`busy_wake_round_trip_us`), and after a pause of `pause_s` in which both
    threads sleep (`idle_wake_round_trip_us`). Every hop of the stack wakes a waiting thread
    like this, and at low load it wakes one whose CPU went idle: what that costs is a property
    of the host (its idle states, a hypervisor's halt), not of the code. Two H100 hosts gave
    the same stack first tokens 3 ms apart at one stream (docs/gpu.md, "Runs 68-70"); this
    probe puts a measure of the host's part beside every figure."""
    left, right = socket.socketpair()

    def echo() -> None:
        while data := right.recv(1):
            right.send(data)

    thread = threading.Thread(target=echo, name="wake-probe", daemon=True)
    thread.start()
    try:
        busy_us = [_round_trip_us(left) for _ in range(busy)]
        idle_us: list[float] = []
        for _ in range(idle):
            time.sleep(pause_s)
            idle_us.append(_round_trip_us(left))
    finally:
        left.close()  # the echo thread's recv() returns b"": it ends
        thread.join(timeout=1.0)
        right.close()
    return {"busy_wake_round_trip_us": round(statistics.median(busy_us), 1),
            "idle_wake_round_trip_us": round(statistics.median(idle_us), 1)}


def _round_trip_us(sock: socket.socket) -> float:
    start = time.perf_counter()
    sock.send(b"x")
    sock.recv(1)
    return (time.perf_counter() - start) * 1e6


def speed_text(speed: dict[str, float]) -> str:
    """`host_speed()` in words, for a log or a doc's machine line."""
    text = (f"{speed['python_loop_ns']} ns a Python loop iteration, "
            f"{speed['socket_round_trip_us']} us a socket round trip")
    if "idle_wake_round_trip_us" in speed:  # results written before the wake-up probe lack it
        text += (f", {speed['busy_wake_round_trip_us']} / {speed['idle_wake_round_trip_us']} us "
                 f"a round trip to a waiting thread, busy / after {_WAKE_PAUSE_S * 1e3:g} ms idle")
    return text


def machine_info(command: list[str] | None = None) -> dict[str, Any]:
    """What a figure was measured on: CPU, cores, Python, OS, date and the command."""
    try:
        usable_cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable_cores = os.cpu_count() or 0
    return {
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "usable_cores": usable_cores,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host_speed": host_speed(),
        "command": " ".join(command if command is not None else sys.argv),
    }


def record_to_json(record: RequestRecord) -> dict[str, Any]:
    data = asdict(record)
    data.update(jct_s=record.jct_s, tpot_s=record.tpot_s, output_tokens=record.output_tokens)
    return data


def write_results(out_dir: Path, result: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS_FILE
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return path


def read_results(path: Path) -> dict[str, Any]:
    """A run's results from its directory or its JSON file."""
    file = path / RESULTS_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path}: no {RESULTS_FILE} there")
    data: dict[str, Any] = json.loads(file.read_text(encoding="utf-8"))
    return data
