"""router_bench's report: medians over the rounds, per pattern x build and per concurrency x
build, printed as Markdown tables (median [min-max] of the per-round figures)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def _med(values: Sequence[float]) -> str:
    """median [min-max] of per-round figures."""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Medians over the rounds, per pattern x build and per concurrency x build."""
    rtt_ms = statistics.median(report["echo_rtt_ms"])
    out: dict[str, Any] = {"echo_rtt_ms": rtt_ms, "patterns": {}, "relay": {}}
    for name, row in report["patterns"].items():
        for build in (b for b in report["builds"] if b in row["rounds"][0]):
            added = [r[build]["added_ms"] for r in row["rounds"]]
            out["patterns"][f"{name} / {build}"] = {
                "direct_ms": [r["direct_ms"] for r in row["rounds"]],
                "router_ms": [r[build]["router_ms"] for r in row["rounds"]],
                "added_ms": added,
                "added_rtt_per_call": [a / rtt_ms / row["engine_calls"] for a in added],
                "cpu_ms_per_request": [r[build]["cpu_ms_per_request"] for r in row["rounds"]],
            }
    for concurrency, rounds in report["relay"].items():
        for build in (b for b in report["builds"] if b in rounds[0]):
            out["relay"][f"{concurrency} / {build}"] = {
                "direct_tokens_per_s": [r["direct"]["tokens_per_s"] for r in rounds],
                "router_tokens_per_s": [r[build]["tokens_per_s"] for r in rounds],
                "ratio": [r[build]["ratio"] for r in rounds],
                "whole_run_ratio": [r[build]["whole_run_tokens_per_s"] / r["direct"]["whole_run_tokens_per_s"]
                                    for r in rounds],
                "cpu_us_per_token": [r[build]["cpu_us_per_token"] for r in rounds],
                "engine_cpu_us_per_token": [r["direct"]["cpu_us_per_token"] for r in rounds],
            }
    return out


def print_report(report: dict[str, Any]) -> None:
    summary = summarize(report)
    print(f"machine: {report['machine']}; engines on {report['engine_device']}; {report['rounds']} rounds, "
          f"each cell median [min-max] over the rounds; CPUs: {report.get('cpus', 'all shared')}")
    print(f"raw grpc.aio unary echo round trip: {summary['echo_rtt_ms']:.3f} ms (median of the rounds)")
    print("| pattern / build | direct ms | router ms | added ms (median of pairs) | added RTT per call "
          "| router CPU ms per request |")
    print("|---|---|---|---|---|---|")
    for key, row in summary["patterns"].items():
        print(f"| {key} | {_med(row['direct_ms'])} | {_med(row['router_ms'])} | {_med(row['added_ms'])} | "
              f"{_med(row['added_rtt_per_call'])} | {_med(row['cpu_ms_per_request'])} |")
    print("| streams / build | direct tok/s | router tok/s | ratio (steady) | ratio (whole run) "
          "| router CPU us per token | engine CPU us per token (direct) |")
    print("|---|---|---|---|---|---|---|")
    for key, row in summary["relay"].items():
        print(f"| {key} | {_med(row['direct_tokens_per_s'])} | {_med(row['router_tokens_per_s'])} | "
              f"{_med(row['ratio'])} | {_med(row['whole_run_ratio'])} | {_med(row['cpu_us_per_token'])} | "
              f"{_med(row['engine_cpu_us_per_token'])} |")
