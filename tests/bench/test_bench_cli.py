"""`microserving bench` and `microserving bench compare` write their JSON and PNG files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_timed_server import MODEL_ID, Timing, serve_timed

from bench.cli import main
from bench.docs_update import machine_line
from microserving.cli import main as microserving_main

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _bench(base_url: str, out: Path, *load: str) -> int:
    return main([
        "--base-url", base_url, *load, "--num-prompts", "6", "--warmup", "1",
        "--input-len", "uniform:10,20", "--output-len", "4", "--label", "timed",
        "--no-progress", "--out", str(out),
    ])


def test_bench_writes_results_json_with_machine_info_and_a_cdf_png(tmp_path: Path) -> None:
    with serve_timed(Timing(0.01, 0.002)) as base_url:
        assert _bench(base_url, tmp_path / "run", "--concurrency", "2") == 0
    result = json.loads((tmp_path / "run" / "results.json").read_text())
    assert result["config"]["model"] == MODEL_ID
    assert result["config"]["concurrency"] == 2
    assert result["summary"]["num_completed"] == 6
    machine = result["machine"]
    assert machine["cpu_cores"] >= 1 and machine["cpu_model"] and machine["python"]
    assert "--concurrency 2" in machine["command"]
    speed = machine["host_speed"]
    assert speed["python_loop_ns"] > 0 and speed["socket_round_trip_us"] > 0
    # the wake-up probe measured something: a round trip through another thread makes the
    # same syscalls as the socket pair's within one and more (loosely bounded: no timing test)
    assert speed["idle_wake_round_trip_us"] > 0
    assert speed["busy_wake_round_trip_us"] > speed["socket_round_trip_us"] / 4
    line = machine_line(machine)
    assert f"{speed['python_loop_ns']} ns a Python loop iteration" in line
    assert f"{speed['socket_round_trip_us']} us a socket round trip" in line
    assert (f"{speed['busy_wake_round_trip_us']} / {speed['idle_wake_round_trip_us']} us a round "
            "trip to a waiting thread") in line
    assert (tmp_path / "run" / "cdf.png").read_bytes().startswith(PNG_MAGIC)


def test_compare_draws_runs_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with serve_timed(Timing(0.01, 0.002)) as base_url:
        assert _bench(base_url, tmp_path / "c1", "--concurrency", "1") == 0
        assert _bench(base_url, tmp_path / "r5", "--request-rate", "5") == 0
    out = tmp_path / "cmp"
    assert microserving_main(["bench", "compare", str(tmp_path / "c1"), str(tmp_path / "r5"),
                              "--out", str(out)]) == 0
    for name in ("latency_vs_load.png", "cdf.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC)
    table = (out / "table.md").read_text()
    assert table.count("| timed |") == 2
    assert "| timed |" in capsys.readouterr().out


def test_compare_of_a_missing_run_fails_cleanly(tmp_path: Path) -> None:
    assert main(["compare", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 1


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(SystemExit):
        main(["--base-url", "http://x", "--concurrency", "1", "--input-len", "uniform:9,1"])
    with pytest.raises(SystemExit):
        main(["--base-url", "http://x"])  # neither concurrency nor rate
