"""PNG plots with matplotlib (headless): CDFs of one or many runs, and latency against load."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

METRICS = (("ttft_s", "TTFT"), ("jct_s", "JCT (end-to-end)"))
STATS = ("mean", "p50", "p90", "p99")


def run_label(result: dict[str, Any]) -> str:
    return str(result["config"].get("label") or "run")


def offered_load(result: dict[str, Any]) -> tuple[str, float]:
    """(axis name, value) of a run's load: its request rate or its concurrency."""
    config = result["config"]
    if config.get("request_rate") is not None:
        return "request rate (req/s)", float(config["request_rate"])
    return "concurrency", float(config.get("concurrency") or 0)


def _values(result: dict[str, Any], metric: str) -> list[float]:
    return sorted(
        r[metric] for r in result["requests"] if r.get("error") is None and r.get(metric) is not None
    )


def _styles(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One color per label, one line style per load within a label."""
    labels = sorted({run_label(r) for r in results})
    loads = sorted({offered_load(r)[1] for r in results})
    colors = [plt.get_cmap("tab10")(i) for i in range(10)]
    styles = ("-", "--", ":", "-.")
    return [{"color": colors[labels.index(run_label(r)) % len(colors)],
             "linestyle": styles[loads.index(offered_load(r)[1]) % len(styles)]} for r in results]


def plot_cdfs(results: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """TTFT and JCT CDFs, one line per run (color: label, line style: load)."""
    fig, axes = plt.subplots(1, len(METRICS), figsize=(12, 4.5))
    styles = _styles(results)
    for ax, (metric, name) in zip(axes, METRICS, strict=True):
        for result, style in zip(results, styles, strict=True):
            values = _values(result, metric)
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                _, load = offered_load(result)
                label = f"{run_label(result)} @ {load:g}" if len(results) > 1 else run_label(result)
                ax.step(values, ys, where="post", label=label, **style)
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize="x-small", loc="lower right")
    return _save(fig, path, title or "latency CDFs")


def plot_latency_vs_load(results: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Mean and p50/p90/p99 of TTFT and JCT against offered load, one line per label."""
    series: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
    axis_name = "load"
    for result in results:
        axis_name, load = offered_load(result)
        series[run_label(result)].append((load, result["summary"]))
    fig, axes = plt.subplots(len(METRICS), len(STATS), figsize=(4 * len(STATS), 7), squeeze=False)
    for row, (metric, name) in enumerate(METRICS):
        for col, stat in enumerate(STATS):
            ax = axes[row][col]
            for label, points in sorted(series.items()):
                points = sorted((p for p in points if p[1].get(metric)), key=lambda p: p[0])
                ax.plot([p[0] for p in points], [p[1][metric][stat] for p in points], "o-", label=label)
            ax.set_title(f"{stat} {name}")
            ax.set_xlabel(axis_name)
            ax.set_ylabel("seconds")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    return _save(fig, path, title or "latency against load")


def _save(fig: Any, path: Path, title: str) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
