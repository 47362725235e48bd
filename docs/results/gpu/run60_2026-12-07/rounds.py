"""Run 60's three rounds as one table: two rounds from the first call of each pattern
(calls12/) and the third from the call after it on the same machine (call3/); each cell
against the engine alone run cold right before it. Medians and ranges over the rounds.

    python3 docs/results/gpu/run60_2026-12-07/rounds.py
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def cells(pattern_dir: str) -> list[dict]:
    rows = []
    for call in ("calls12", "call3"):
        path = HERE / call / pattern_dir / "cells.jsonl"
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def spread(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


print("| pattern | streams | rounds | engine alone tok/s | stack tok/s | ratio | TTFT +p50 ms | CPU ms per 1k |")
print("|---|---|---|---|---|---|---|---|")
for pattern_dir in ("rr", "disagg"):
    rows = cells(pattern_dir)
    for streams in sorted({r["streams"] for r in rows}):
        these = [r for r in rows if r["streams"] == streams]
        print(f"| {these[0]['pattern']} | {streams} | {len(these)} "
              f"| {statistics.median(r['nominal_tok_s'] for r in these):,.0f} "
              f"| {statistics.median(r['client_tok_s'] for r in these):,.0f} "
              f"| {spread([r['ratio'] for r in these], '{:.2f}')} "
              f"| {spread([r['ttft_added_p50_ms'] for r in these], '{:.2f}')} "
              f"| {statistics.median(r['cpu_ms_per_1k_tokens']['total'] for r in these):.1f} |")
