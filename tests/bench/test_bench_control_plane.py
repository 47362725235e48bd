"""The control-plane benchmark's floors (as real processes) and its report arithmetic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.control_plane_report import markdown, report, rows
from bench.control_plane_run import CellShape, http_cell
from bench.floors import echo_round_trips_s
from bench.procs import service_group

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
async def test_floors_run_as_processes_and_are_measured(tmp_path: Path) -> None:
    with service_group(tmp_path) as group:
        echo = group.start("echo", ["echo"], module="bench.floors", timeout_s=60)
        sse = group.start("sse", ["sse"], module="bench.floors", timeout_s=60)
        times = await echo_round_trips_s(echo.address, concurrency=4, calls_per_worker=10)
        summary = await http_cell(f"http://{sse.address}/v1", "floor", 4,
                                  CellShape(prompt_len=8, output_len=5, min_requests=8), salt=1)
        processes = [s.process for s in group.services]
    assert len(times) == 40 and all(0 < t < 1 for t in times)
    assert summary["num_errors"] == 0 and summary["output_tokens"] == 8 * 5
    assert all(p.poll() is not None for p in processes)  # stopped with the group


def _summary(ttft_p50_s: float, tokens_per_s: float) -> dict[str, Any]:
    return {"ttft_s": {"p50": ttft_p50_s}, "output_tokens_per_s": tokens_per_s, "num_errors": 0}


def _result() -> dict[str, Any]:
    cells = []
    for depth, ttft, rate in (("direct", 0.010, 1000.0), ("router", 0.013, 950.0),
                              ("gateway", 0.016, 900.0)):
        cells.append({"pattern": "disagg", "depth": depth, "concurrency": 1,
                      "num_engine_calls": 3, "summary": _summary(ttft, rate)})
    floors = {"echo_rtt_s": {"1": {"p50": 0.0005, "p99": 0.001}},
              "sse": {"1": _summary(0.002, 5000.0)}}
    return {"config": {"patterns": ["disagg"], "concurrencies": [1]}, "floors": floors,
            "cells": cells}


def test_added_latency_is_counted_in_round_trips_per_engine_call() -> None:
    (row,) = rows(_result())
    assert row["router_added_ttft_s"] == pytest.approx(0.003)
    assert row["router_added_rtts_per_call"] == pytest.approx(0.003 / 0.0005 / 3)
    assert row["gateway_added_ttft_s"] == pytest.approx(0.003)
    assert row["router_relay_ratio"] == pytest.approx(0.95)
    assert row["gateway_relay_ratio"] == pytest.approx(0.9)


def test_report_writes_a_table_and_a_plot(tmp_path: Path) -> None:
    table = report(_result(), tmp_path)
    assert "| disagg | 1 | 10.00 | 13.00 | 16.00 | 3.00 | 2.00 |" in table
    assert (tmp_path / "table.md").read_text() == markdown(_result())
    assert (tmp_path / "control_plane.png").read_bytes().startswith(PNG_MAGIC)


def test_repeated_rounds_are_summarised_by_their_median() -> None:
    result = _result()
    extra = []
    for ttft, rate in ((0.020, 500.0), (0.030, 400.0)):
        extra.append({"pattern": "disagg", "depth": "router", "concurrency": 1,
                      "num_engine_calls": 3, "summary": _summary(ttft, rate)})
    result["cells"] += extra
    (row,) = rows(result)
    assert row["ttft_p50_s"]["router"] == pytest.approx(0.020)  # median of 13, 20, 30 ms
    assert row["tokens_per_s"]["router"] == pytest.approx(500.0)  # median of 950, 500, 400
    assert row["ttft_p50_s"]["direct"] == pytest.approx(0.010)


def test_a_service_that_exits_without_an_address_fails_with_its_output(tmp_path: Path) -> None:
    from bench.procs import start_service

    with pytest.raises(RuntimeError, match="unknown command"):
        start_service("bogus", ["no-such-command"], tmp_path, timeout_s=30)
    assert "unknown command" in (tmp_path / "bogus.log").read_text()
