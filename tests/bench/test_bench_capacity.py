"""`microserving bench capacity --toy` end to end: real gateway, router and synthetic shims for
both patterns (the router a process of its own, or in the gateway's: `microserving serve`); every row is present with every token counted, a ratio that the schedule
bounds, and CPU figures for each control-plane process."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOY_REQUESTS, TOY_OUTPUT_LEN, TOY_STREAMS = 8, 16, (1, 4)

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("topology", [[], ["--embed-router"]], ids=["split", "serve"])
def test_capacity_toy_run_reports_every_row(tmp_path: Path, topology: list[str]) -> None:
    """Split: gateway and router processes; serve: the router in the gateway's process, its
    metrics read from the gateway's /metrics."""
    done = subprocess.run(
        [sys.executable, "-m", "microserving.cli", "bench", "capacity", "--toy", "--out", str(tmp_path),
         *topology],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| round-robin | 4 |" in done.stdout and "| disagg | 1 |" in done.stdout
    report = json.loads((tmp_path / "capacity.json").read_text())
    assert (tmp_path / "table.md").read_text().startswith("| pattern | streams |")
    rows = {(r["pattern"], r["streams"]): r for r in report["rows"]}
    assert set(rows) == {(p, s) for p in ("round-robin", "disagg") for s in TOY_STREAMS}
    # Every cell as it was measured, one JSON line each, written as the run went.
    cells = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert len(cells) == len(rows)
    for (pattern, _), row in rows.items():
        assert row["client_processes"] == 1
        assert row["num_errors"] == 0, row["errors"]
        assert row["num_requests_finished"] == TOY_REQUESTS
        assert row["num_tokens"] == TOY_REQUESTS * TOY_OUTPUT_LEN
        assert row["completion_tokens_min"] == row["completion_tokens_max"] == TOY_OUTPUT_LEN
        # The synthetic engines never run faster than their schedule.
        assert 0 < row["ratio"] <= 1.05
        assert row["client_tok_s"] == pytest.approx(row["ratio"] * row["nominal_tok_s"])
        assert math.isfinite(row["ttft_added_p50_ms"]) and row["itl_p99_ms"] > 0
        # Each cell's line on stderr carries its first token as it ends (a run cut short
        # before the table keeps it): one round, so the row's median is that cell's figure.
        lines = [line for line in done.stderr.splitlines()
                 if line.split()[:3] == [pattern, "streams", str(row["streams"])]]
        assert len(lines) == report["config"]["rounds"] == 1, lines
        assert f"first token {row['ttft_added_p50_ms']:+.2f} ms, CPU " in lines[0], lines[0]
        kept = [cell for cell in cells if (cell["pattern"], cell["streams"]) == (pattern, row["streams"])]
        assert len(kept) == 1 and kept[0]["round"] == 0 and kept[0]["ab_value"] is None
        assert kept[0]["ttft_added_p50_ms"] == row["ttft_added_p50_ms"]
        assert kept[0]["client_tok_s"] == row["client_tok_s"]
        # Busy cores outside the stack and the client: the interrupts' share and the busiest
        # other processes (the exclusion itself: test_capacity_cpu.py).
        assert kept[0]["irq_cores"] >= 0
        assert all(set(other) == {"pid", "name", "cores"} and other["cores"] >= 0.02
                   for other in kept[0]["other_processes"])
        assert 1 <= row["tokens_per_chunk"] <= TOY_OUTPUT_LEN
        shims = {"round-robin": {"shim-both"}, "disagg": {"shim-prefill", "shim-decode"}}[pattern]
        cpu = row["cpu_ms_per_1k_tokens"]
        embedded = "--embed-router" in topology
        assert set(cpu) == {"gateway", "total", *shims} | ({"router"} if not embedded else set())
        assert set(row["engine_thread_ms_per_1k_tokens"]) == shims
        # Each shim's /metrics was read at the window's edges (the synthetic engine keeps no
        # step counters: none are reported, and none invented).
        assert row["engine_steps"] == {name: {"steps": 0} for name in shims}
        assert all(v >= 0 for v in cpu.values()) and cpu["total"] > 0
        assert cpu["total"] == pytest.approx(sum(v for k, v in cpu.items() if k != "total"))
        # What the routers timed: every request's first token, and disagg's engine calls
        # (one PrepRecv and one RemoteSend per request in the window).
        assert row["router_ttft"]["count"] >= 1 and row["router_ttft"]["p50_ms"] > 0
        # The gateway's own, from its /metrics: every request of the cell, no more (a fixed
        # count: the window is the whole cell), and read once where the router shares the page.
        assert row["gateway_ttft"]["count"] == TOY_REQUESTS and row["gateway_ttft"]["p50_ms"] > 0
        assert row["client_cpu_ms_per_1k_tokens"] > 0
        calls = row["engine_calls"]
        if pattern == "disagg":
            assert set(calls) == {"prep_recv", "remote_send"}
            assert calls["remote_send"]["count"] >= 1
            assert 0 < calls["remote_send"]["p50_ms"] <= calls["remote_send"]["p99_ms"]
        else:
            assert calls == {}


def test_min_requests_lifts_small_cells_only() -> None:
    from bench.capacity.cli import _load_specs, _num_requests, build_parser

    args = build_parser().parse_args(
        ["--out", "x", "--requests-per-stream", "4", "--min-requests", "24"])
    _, spec = _load_specs(args)
    assert [_num_requests(args, spec, streams) for streams in (1, 4, 64)] == [24, 24, 256]
    plain = build_parser().parse_args(["--out", "x", "--requests-per-stream", "4"])
    _, spec = _load_specs(plain)
    assert _num_requests(plain, spec, 1) == 4


def test_client_processes_share_the_load_exactly() -> None:
    from bench.capacity.client import LoadSpec
    from bench.capacity.client_processes import deal, shares

    assert deal(7, 3) == [3, 2, 2] and deal(2, 4) == [1, 1, 0, 0]
    spec = LoadSpec(base_url="", model="m", streams=7, input_len=4, output_len=4, num_requests=30,
                    seed=5)
    parts = shares(spec, 3)
    assert [p.streams for p in parts] == [3, 2, 2]
    assert sum(p.num_requests or 0 for p in parts) == 30
    assert all(abs((p.num_requests or 0) - 30 * p.streams / 7) < 1 for p in parts)
    assert len({p.seed for p in parts}) == 3
    # No process without a stream; a timed load stays timed in every part.
    timed = LoadSpec(base_url="", model="m", streams=2, input_len=4, output_len=4, duration_s=3.0)
    assert [(p.streams, p.num_requests, p.duration_s) for p in shares(timed, 4)] == [
        (1, None, 3.0), (1, None, 3.0)]


def test_ab_values_and_client_processes_take_turns(tmp_path: Path) -> None:
    """--ab-env: each value a row of its own, measured on a stack started with it for every
    round (the logs show one stack per value and round), in the other order each round; on
    each stack, the load from one client process and from two in turn (--client-processes),
    every request and token of the two processes counted once."""
    done = subprocess.run(
        [sys.executable, "-m", "microserving.cli", "bench", "capacity", "--out", str(tmp_path),
         "--patterns", "round-robin", "--streams", "2", "--requests", "4", "--output-len", "8",
         "--rounds", "2", "--ab-env", "MICROSERVING_ROUTER_SEND_AHEAD", "--ab-values", "false", "true",
         "--client-processes", "1", "2"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "capacity.json").read_text())
    cells = [(row["ab"]["value"], row["client_processes"]) for row in report["rows"]]
    assert cells == [("false", 1), ("true", 1), ("false", 2), ("true", 2)]
    for row in report["rows"]:
        assert row["ab"]["env"] == "MICROSERVING_ROUTER_SEND_AHEAD"
        assert row["num_rounds"] == 2 and row["num_errors"] == 0
        assert row["num_tokens"] == 2 * 4 * 8  # both rounds
        assert row["num_requests_finished"] == 2 * 4
        # The gateway saw every request of the cell, whichever client process sent it.
        assert all(cell["gateway_ttft"]["count"] == 4 for cell in row["rounds"])
        assert row["client_cpu_ms_per_1k_tokens"] > 0
    logs = {p.name for p in (tmp_path / "logs").iterdir()}
    assert {f"round-robin-{v}-r{r}-gateway.log" for v in ("false", "true") for r in (0, 1)} <= logs
    # Round 0: false then true, one client process then two; round 1 the other way round.
    order = [(line.split("[")[1].split("]")[0], "2 client processes" in line)
             for line in done.stderr.splitlines() if " round " in line and "[" in line]
    assert order == [("false", False), ("false", True), ("true", False), ("true", True),
                     ("true", True), ("true", False), ("false", True), ("false", False)]
    header = (tmp_path / "table.md").read_text().splitlines()[0]
    assert "| MICROSERVING_ROUTER_SEND_AHEAD | client processes |" in header


def test_alone_each_round_measures_each_round_against_its_own_yardstick(tmp_path: Path) -> None:
    """--backend embedded --alone-each-round: the engine alone runs again right before each
    round's cells, and each round's ratio is against that run (printed, then in the JSON); the
    pass before the stacks runs only the staggered variant, once, for its column."""
    done = subprocess.run(
        [sys.executable, "-m", "microserving.cli", "bench", "capacity", "--out", str(tmp_path),
         "--backend", "embedded", "--model", "tiny", "--device", "cpu", "--patterns", "round-robin",
         "--streams", "1", "--requests", "2", "--input-len", "8", "--output-len", "4",
         "--rounds", "2", "--alone-each-round"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    yardsticks = [float(line.split(": ")[1].split(" tok/s")[0].replace(",", ""))
                  for line in done.stderr.splitlines() if "this round's yardstick" in line]
    assert len(yardsticks) == 2
    # Up front, before any stack: only the staggered run, once (the yardstick comes each round).
    up_front = [line for line in done.stderr.splitlines()
                if "engine alone streams" in line and "yardstick" not in line]
    assert len(up_front) == 1 and "round 0 staggered" in up_front[0], up_front
    [row] = json.loads((tmp_path / "capacity.json").read_text())["rows"]
    assert row["alone_staggered_tok_s"] > 0
    assert row["num_errors"] == 0 and row["num_tokens"] == 2 * 2 * 4
    for cell, yardstick in zip(row["rounds"], yardsticks, strict=True):
        assert cell["nominal_tok_s"] == pytest.approx(yardstick, abs=0.51)  # printed rounded
        assert cell["ratio"] == pytest.approx(cell["client_tok_s"] / cell["nominal_tok_s"])


def test_staggered_streams_start_apart() -> None:
    """--stagger-ms: stream i sends its first request i * stagger after the start (the load
    then does not run in waves); without it, every stream starts at once."""
    import asyncio

    from bench.capacity.cli import _load_specs, build_parser
    from bench.capacity.client import drive

    args = build_parser().parse_args(["--out", "x", "--requests", "4", "--stagger-ms", "40"])
    _, spec = _load_specs(args)
    assert spec.stagger_s == 0.04

    async def starts(stagger_s: float) -> list[float]:
        async def send(ids, record, window, origin_s) -> None:  # type: ignore[no-untyped-def]
            await asyncio.sleep(1.0)  # each stream sends one request in this test

        result = await drive(replace(spec, streams=4, stagger_s=stagger_s), send, lambda edge: None)
        return sorted(record.started_s for record in result.records)

    staggered, together = asyncio.run(starts(0.04)), asyncio.run(starts(0.0))
    assert len(staggered) == len(together) == 4
    assert all(at >= 0.04 * index for index, at in enumerate(staggered))  # never early
    assert staggered[-1] - staggered[0] >= 0.11 and together[-1] - together[0] < 0.1


def _children(pid: int) -> set[int]:
    """The processes whose parent is `pid`."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_capacity_run_ended_by_sigterm_stops_its_stack(tmp_path: Path) -> None:
    """`timeout` or a cancelled job SIGTERMs the benchmark: it stops the services it started
    (before, they outlived it, each in a session of its own, taking the CPU from the next run)."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "microserving.cli", "bench", "capacity", "--toy", "--out", str(tmp_path),
         "--patterns", "disagg", "--requests", "100000"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        services: set[int] = set()
        while len(services) < 4 and time.monotonic() < deadline:  # two shims, router, gateway
            services = {pid for pid in _children(bench.pid)
                        if "microserving.cli" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")}
            time.sleep(0.2)
        assert len(services) >= 4, services
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=120)
        deadline = time.monotonic() + 30
        while any(_is_running(pid) for pid in services) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {pid for pid in services if _is_running(pid)}
    finally:
        if bench.poll() is None:
            bench.kill()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "services outlived the benchmark"
