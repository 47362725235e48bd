"""`microserving bench mlc-relay --toy` end to end: real mlc-compat engines (benchmark-only
synthetic core), `shim --backend mlc`, the router, a direct HTTP client and a RouterClient, for
both patterns; every row of both sides is present with every token counted, and the
comparison carries the ratio, the round trips and CPU figures of each process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOY_REQUESTS, TOY_OUTPUT_LEN, TOY_STREAMS = 8, 16, (1, 4)

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("router", "patterns"), [
    ([], ("round-robin", "disagg")),
    (["--in-process-router", "--patterns", "disagg"], ("disagg",)),
], ids=["process", "in-process"])
def test_mlc_relay_toy_run_compares_both_sides(tmp_path: Path, router: list[str], patterns: tuple[str, ...]) -> None:
    """The relay's router as a process of its own, or in the benchmark's process
    (router/inprocess.py, as `microserving serve` runs it; disagg alone, the pattern with the
    most hops)."""
    done = subprocess.run(
        [sys.executable, "-m", "microserving.cli", "bench", "mlc-relay", "--toy", "--out", str(tmp_path),
         *router],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("| round-robin | 4 |" in done.stdout) == ("round-robin" in patterns)
    assert "| disagg | 1 |" in done.stdout
    assert (tmp_path / "table.md").read_text().startswith("| pattern | streams |")
    report = json.loads((tmp_path / "mlc_relay.json").read_text())
    rows = {(r["pattern"], r["streams"]): r for r in report["rows"]}
    assert set(rows) == {(f"{p}/{side}", s) for p in patterns
                         for side in ("direct", "relay") for s in TOY_STREAMS}
    for row in rows.values():
        assert row["num_errors"] == 0, row["errors"]
        assert row["num_requests_finished"] == TOY_REQUESTS
        assert row["num_tokens"] == TOY_REQUESTS * TOY_OUTPUT_LEN
        assert row["completion_tokens_min"] == row["completion_tokens_max"] == TOY_OUTPUT_LEN
        assert 0 < row["ratio"] <= 1.05  # never faster than the engines' schedule
    comparisons = {(c["pattern"], c["streams"]): c for c in report["comparisons"]}
    assert set(comparisons) == {(p, s) for p in patterns for s in TOY_STREAMS}
    for (pattern, streams), c in comparisons.items():
        direct, relay = rows[(f"{pattern}/direct", streams)], rows[(f"{pattern}/relay", streams)]
        assert c["ratio"] == pytest.approx(relay["client_tok_s"] / direct["client_tok_s"])
        assert c["ttft_added_ms"] == pytest.approx(relay["ttft_p50_ms"] - direct["ttft_p50_ms"])
        trips = c["round_trips"]
        assert trips["http_ms"] > 0 and trips["grpc_ms"] > 0
        assert c["ttft_added_http_round_trips"] == pytest.approx(c["ttft_added_ms"] / trips["http_ms"])
        # The direct side passes only the engines; the relay side also the shims and router.
        engines = {"round-robin": {"engine-both"}, "disagg": {"engine-prefill", "engine-decode"}}
        shims = {"round-robin": {"shim-both"}, "disagg": {"shim-prefill", "shim-decode"}}
        assert set(direct["cpu_ms_per_1k_tokens"]) == engines[pattern] | {"total"}
        assert set(relay["cpu_ms_per_1k_tokens"]) == engines[pattern] | shims[pattern] | {
            "router", "total"}
        assert all(v is not None and v >= 0 for v in c["relay_cpu_ms_per_1k_tokens"].values())
    # /proc counts CPU in clock ticks (10 ms), charged to whatever runs at the tick: a row's
    # shims may relay their 128 tokens within less than one tick, and on a busy machine miss
    # every tick (one full-suite run with both cores loaded read 0.0 for a row). Over the
    # whole run their CPU shows.
    assert sum(c["relay_cpu_ms_per_1k_tokens"]["shim"] for c in comparisons.values()) > 0
