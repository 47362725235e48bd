"""`microserving bench dos` against a real `microserving up` stack: a body over the gateway's
limit is answered 413 while the side client's requests are served, and the figures (answer,
side latency, peak RSS of every process) are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microserving.cli import main as microserving_main

pytestmark = pytest.mark.e2e


def test_bench_dos_reports_the_413_and_the_side_requests_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "dos.json"
    argv = ["bench", "dos", "--sizes-mb", "2", "--max-body-bytes", str(1024 * 1024), "--out", str(out)]
    assert microserving_main(argv) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["body_mb"] == 2 and row["status"] == 413 and row["error"] == "request_too_large"
    assert row["side_during_count"] >= 1 and row["side_alone_median_ms"] > 0
    roles = {name.rsplit("-", 1)[0] for name in result["peak_rss_mib"]}
    assert {"gateway", "router"} <= roles and any(role.startswith("shim") for role in roles)
