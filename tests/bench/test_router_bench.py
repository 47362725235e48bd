"""router_bench end to end at toy size: every build it compares (the router with a stream per
request and with one shared client stream, the StartGenerate router, the bare relay) answers,
and the relay is repeated until it has carried the tokens asked for."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_router_bench_measures_every_build(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--rounds", "1", "--samples", "2", "--warmup", "0", "--patterns", "round-robin",
            "--concurrency", "2", "--max-tokens", "4", "--relay-min-tokens", "16", "--out", str(out)]
    # A subprocess: the bench pins itself (and its children) to CPUs.
    subprocess.run([sys.executable, "-m", "bench.router_bench", *args], cwd=REPO, check=True, timeout=240,
                   env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    builds = {"router", "router-startgenerate", "router-one-client-stream", "grpc-relay-floor"}
    (first_token,) = report["patterns"]["round-robin"]["rounds"]
    assert builds <= set(first_token)
    for build in builds:
        assert math.isfinite(first_token[build]["added_ms"])
        assert first_token[build]["router_ms"] > 0
    (relay,) = report["relay"]["2"]
    for build in builds:
        assert relay[build]["tokens_per_s"] > 0 and relay[build]["ratio"] > 0
        assert relay[build]["repeats"] == 2  # 16 tokens / (2 streams x 4 tokens)
    if len(os.sched_getaffinity(0)) >= 2:
        assert report["cpus"]["engines"] and report["cpus"]["routers_and_clients"]
        assert not set(report["cpus"]["engines"]) & set(report["cpus"]["routers_and_clients"])
