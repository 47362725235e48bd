"""Tables and a plot of a control-plane result (bench/control_plane.py), with the goals:
the router adds < 1.5 raw gRPC round trips per engine call to the first token, and relays
>= 90% of the token rate a client gets from the engines directly."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MAX_ADDED_RTTS_PER_CALL = 1.5
MIN_RELAY_RATIO = 0.9
DEPTHS = ("direct", "router", "gateway")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f}"


def _p50(summary: dict[str, Any], metric: str = "ttft_s") -> float | None:
    figures = summary.get(metric)
    return None if not figures else float(figures["p50"])


def _index(result: dict[str, Any]) -> dict[tuple[str, int, str], list[dict[str, Any]]]:
    """Cells by (pattern, concurrency, depth): one per round."""
    index: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for cell in result["cells"]:
        index.setdefault((cell["pattern"], cell["concurrency"], cell["depth"]), []).append(cell)
    return index


def _median_of(cells: list[dict[str, Any]], pick: Any) -> float | None:
    values = [v for v in (pick(c["summary"]) for c in cells) if v is not None]
    return statistics.median(values) if values else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per pattern and concurrency: TTFT p50 per depth, added latency, relay ratios
    (medians over rounds).
    A depth that was not measured (its service failed to start) shows as None."""
    cells = _index(result)
    rtt_s = result["floors"]["echo_rtt_s"][str(min(result["config"]["concurrencies"]))]["p50"]
    out = []
    for pattern in result["config"]["patterns"]:
        for c in result["config"]["concurrencies"]:
            found = {d: cells[(pattern, c, d)] for d in DEPTHS if (pattern, c, d) in cells}
            if "direct" not in found:
                continue
            ttft = {d: _median_of(found[d], _p50) if d in found else None for d in DEPTHS}
            rate = {d: _median_of(found[d], lambda s: s["output_tokens_per_s"])
                    if d in found else None for d in DEPTHS}
            calls = found["direct"][0]["num_engine_calls"]
            added = _minus(ttft["router"], ttft["direct"])
            out.append({
                "pattern": pattern, "concurrency": c, "ttft_p50_s": ttft, "tokens_per_s": rate,
                "router_added_ttft_s": added,
                "router_added_rtts_per_call": None if added is None else added / rtt_s / calls,
                "gateway_added_ttft_s": _minus(ttft["gateway"], ttft["router"]),
                "router_relay_ratio": _ratio(rate["router"], rate["direct"]),
                "gateway_relay_ratio": _ratio(rate["gateway"], rate["direct"]),
                "errors": sum(c["summary"]["num_errors"] for cells_ in found.values() for c in cells_),
            })
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| pattern | streams | TTFT p50 direct (ms) | router (ms) | gateway (ms) | router added "
        f"(ms) | added RTTs / engine call (goal < {MAX_ADDED_RTTS_PER_CALL}) | direct tok/s | "
        f"router relay (goal >= {MIN_RELAY_RATIO}) "
        "| gateway relay | errors |",
        "|" + "---|" * 11,
    ]
    for r in rows(result):
        t = r["ttft_p50_s"]
        lines.append(
            f"| {r['pattern']} | {r['concurrency']} | {_ms(t['direct'])} | {_ms(t['router'])} | "
            f"{_ms(t['gateway'])} | {_ms(r['router_added_ttft_s'])} | "
            f"{_fmt(r['router_added_rtts_per_call'], '.2f')} | {_fmt(r['tokens_per_s']['direct'], '.0f')} | "
            f"{_fmt(r['router_relay_ratio'], '.2f')} | {_fmt(r['gateway_relay_ratio'], '.2f')} | "
            f"{r['errors']} |"
        )
    lines += ["", "| streams | echo RTT p50 (ms) | echo RTT p99 (ms) | bare SSE TTFT p50 (ms) "
              "| bare SSE tok/s |", "|---|---|---|---|---|"]
    floors = result["floors"]
    for c in result["config"]["concurrencies"]:
        echo, sse = floors["echo_rtt_s"][str(c)], floors["sse"][str(c)]
        lines.append(f"| {c} | {_ms(echo['p50'])} | {_ms(echo['p99'])} | {_ms(_p50(sse))} | "
                     f"{sse['output_tokens_per_s']:.0f} |")
    for failure in result.get("failures", []):
        lines += ["", f"Not measured: {failure.splitlines()[0]}"]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> Path:
    table = rows(result)
    labels = [f"{r['pattern'].replace('-disagg', '')}\n@{r['concurrency']}" for r in table]
    fig, (ax_ttft, ax_rate) = plt.subplots(2, 1, figsize=(max(8, len(labels) * 1.1), 8))
    width = 0.27
    for k, depth in enumerate(DEPTHS):
        xs = [i + (k - 1) * width for i in range(len(table))]
        ax_ttft.bar(xs, [(r["ttft_p50_s"][depth] or 0) * 1000 for r in table], width, label=depth)
        ax_rate.bar(xs, [r["tokens_per_s"][depth] or 0 for r in table], width, label=depth)
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT p50 (ms, log)")
    ax_rate.set_ylabel("output tokens/s")
    for ax in (ax_ttft, ax_rate):
        ax.set_xticks(range(len(table)), labels, fontsize="small")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("control plane: the same engines, direct / through the router / through the gateway")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(result: dict[str, Any], out_dir: Path) -> str:
    """Write table.md and control_plane.png into out_dir; return the table."""
    table = markdown(result)
    (out_dir / "table.md").write_text(table, encoding="utf-8")
    plot(result, out_dir / "control_plane.png")
    return table
