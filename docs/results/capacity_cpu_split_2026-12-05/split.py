"""Each control-plane process's CPU split into a cost per request and a cost per token, from
`bench capacity` runs that differ only in --output-len: a process's CPU per 1,000 relayed
tokens is modelled as per_request_ms * 1000 / L + per_token_us (L = output tokens), fitted
by least squares over the runs, per pattern.

    python3 split.py DIR_L16 DIR_L64 DIR_L256 ...   (each holding a capacity.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept) of y = slope * x + intercept, least squares."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return slope, mean_y - slope * mean_x


def main() -> None:
    rows = []
    for directory in sys.argv[1:]:
        data = json.loads((Path(directory) / "capacity.json").read_text())
        length = data["config"]["output_len"]
        for row in data["rows"]:
            rows.append((row["pattern"], row["streams"], length, row))
    for pattern, streams in sorted({(p, s) for p, s, _, _ in rows}):
        cells = sorted((length, row) for p, s, length, row in rows if (p, s) == (pattern, streams))
        print(f"\n{pattern}, {streams} streams; output lengths "
              + ", ".join(f"{length} ({row['tokens_per_chunk']:.2f} tokens a chunk, "
                          f"ratio {row['ratio']:.2f})" for length, row in cells))
        print("| process | per request (ms CPU) | per token (us CPU) | share of CPU at 256 tokens "
              "spent per request |")
        print("|---|---|---|---|")
        processes = [name for name in cells[0][1]["cpu_ms_per_1k_tokens"] if name != "total"]
        for name in [*processes, "total"]:
            points = [(1000 / length, row["cpu_ms_per_1k_tokens"][name]) for length, row in cells]
            per_request_ms, per_token_us = fit(points)
            share = per_request_ms * 1000 / 256 / (per_request_ms * 1000 / 256 + per_token_us)
            print(f"| {name} | {per_request_ms:.2f} | {per_token_us:.1f} | {share:.0%} |")


if __name__ == "__main__":
    main()
