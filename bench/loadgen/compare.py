"""`microserving bench compare RUN ...`: several runs side by side, as plots and a table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.loadgen.plots import offered_load, plot_cdfs, plot_latency_vs_load, run_label

TABLE_COLUMNS = (
    "label", "load", "req/s", "out tok/s", "TTFT mean", "TTFT p99", "JCT mean", "JCT p99",
    "TPOT mean", "errors",
)


def _ms(summary: dict[str, Any], metric: str, stat: str) -> str:
    figures = summary.get(metric)
    return f"{figures[stat] * 1000:.1f} ms" if figures else "-"


def table_row(result: dict[str, Any]) -> list[str]:
    summary = result["summary"]
    _, load = offered_load(result)
    return [
        run_label(result),
        f"{load:g}",
        f"{summary['requests_per_s']:.2f}",
        f"{summary['output_tokens_per_s']:.1f}",
        _ms(summary, "ttft_s", "mean"),
        _ms(summary, "ttft_s", "p99"),
        _ms(summary, "jct_s", "mean"),
        _ms(summary, "jct_s", "p99"),
        _ms(summary, "tpot_s", "mean"),
        str(summary["num_errors"]),
    ]


def markdown_table(results: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of the runs' headline figures, sorted by label then load."""
    ordered = sorted(results, key=lambda r: (run_label(r), offered_load(r)[1]))
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(table_row(r)) + " |" for r in ordered]
    return "\n".join(lines) + "\n"


def compare_runs(results: Sequence[dict[str, Any]], out_dir: Path, title: str = "") -> list[Path]:
    """latency_vs_load.png, cdf.png and table.md in out_dir."""
    if not results:
        raise ValueError("compare needs at least one run")
    out_dir.mkdir(parents=True, exist_ok=True)
    table = out_dir / "table.md"
    table.write_text(markdown_table(results), encoding="utf-8")
    return [
        plot_latency_vs_load(results, out_dir / "latency_vs_load.png", title),
        plot_cdfs(results, out_dir / "cdf.png", title),
        table,
    ]
