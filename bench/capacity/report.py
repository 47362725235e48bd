"""Rounds of one cell folded into a row (medians, with the spread of the headline figures),
and the table `microserving bench capacity` prints."""

from __future__ import annotations

import statistics
from typing import Any

_SPREAD_KEYS = ("client_tok_s", "ratio", "ttft_added_p50_ms", "itl_p99_ms")


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    if isinstance(present[0], dict):
        keys = dict.fromkeys(k for v in present for k in v)
        return {k: _median([v.get(k) for v in present]) for k in keys}
    if isinstance(present[0], int | float) and not isinstance(present[0], bool):
        return statistics.median(present)
    return present[0]


def fold_rounds(pattern: str, streams: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"pattern": pattern, "streams": streams}
    for key in rounds[0]:
        if key == "errors":
            row[key] = [e for r in rounds for e in r[key]][:10]
        elif key in ("num_tokens", "num_errors", "num_requests_started", "num_requests_finished"):
            row[key] = sum(r[key] for r in rounds)
        else:
            row[key] = _median([r[key] for r in rounds])
    total_cpu = [r["cpu_ms_per_1k_tokens"]["total"] for r in rounds]
    row["spread"] = {
        key: _min_max([r[key] for r in rounds]) for key in _SPREAD_KEYS
    } | {"cpu_total_ms_per_1k_tokens": _min_max(total_cpu)}
    row["num_rounds"] = len(rounds)
    row["rounds"] = rounds
    return row


def _min_max(values: list[float | None]) -> list[float] | None:
    present = [v for v in values if v is not None]
    return [min(present), max(present)] if present else None


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _role_sum(cpu: dict[str, float | None], role: str) -> float | None:
    """A role's processes added (router-0, router-1, ... when there are replicas)."""
    values = [v for k, v in cpu.items() if k == role or k.startswith(f"{role}-")]
    return None if not values or None in values else sum(v or 0.0 for v in values)


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table: throughput against the schedule, latency added, and CPU ms per 1,000
    relayed tokens of each control-plane process (shims without their engine thread)."""
    shim_names = sorted({n for r in rows for n in r["cpu_ms_per_1k_tokens"] if n.startswith("shim")})
    head = ["pattern", "streams", "nominal tok/s", "client tok/s", "ratio", "TTFT +p50 ms",
            "ITL p99 ms", "gateway TTFT mean ms", "router TTFT mean ms", "PrepRecv mean ms", "RemoteSend mean ms", "gateway", "router",
            *shim_names, "sum", "engine thr", "client", "busy cores"]
    has_staggered = any("ratio_vs_staggered" in r for r in rows)
    if has_staggered:  # the embedded backend: the engine alone with staggered arrivals too
        head[5:5] = ["alone staggered tok/s", "ratio vs staggered"]
    has_clients = any(r.get("client_processes", 1) != 1 for r in rows)
    if has_clients:
        head[2:2] = ["client processes"]
    ab_names = sorted({r["ab"]["env"] for r in rows if "ab" in r})
    if ab_names:
        head[2:2] = ab_names[:1]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cpu = r["cpu_ms_per_1k_tokens"]
        engine = sum(v or 0.0 for v in r["engine_thread_ms_per_1k_tokens"].values())
        spread = r["spread"]["ratio"]
        ratio = _fmt(r["ratio"], 2) + ("" if not spread or r["num_rounds"] < 2
                                         else f" ({spread[0]:.2f}-{spread[1]:.2f})")
        cells = [r["pattern"], str(r["streams"]), _fmt(r["nominal_tok_s"]), _fmt(r["client_tok_s"]),
                 ratio, _fmt(r["ttft_added_p50_ms"], 2), _fmt(r["itl_p99_ms"], 2),
                 # means: exact from the histograms' sums (their quantiles are only as fine as
                 # the buckets; both are in the JSON)
                 _fmt((r.get("gateway_ttft") or {}).get("mean_ms"), 2),
                 _fmt((r.get("router_ttft") or {}).get("mean_ms"), 2),
                 _fmt((r.get("engine_calls") or {}).get("prep_recv", {}).get("mean_ms"), 2),
                 _fmt((r.get("engine_calls") or {}).get("remote_send", {}).get("mean_ms"), 2),
                 _fmt(_role_sum(cpu, "gateway"), 1), _fmt(_role_sum(cpu, "router"), 1),
                 *(_fmt(cpu.get(n), 1) for n in shim_names), _fmt(cpu["total"], 1),
                 _fmt(engine, 1), _fmt(r["client_cpu_ms_per_1k_tokens"], 1),
                 _fmt(r["machine_busy_cores"], 2)]
        if has_staggered:
            cells[5:5] = [_fmt(r.get("alone_staggered_tok_s")), _fmt(r.get("ratio_vs_staggered"), 2)]
        if has_clients:
            cells[2:2] = [str(r.get("client_processes", 1))]
        if ab_names:
            cells[2:2] = [str(r.get("ab", {}).get("value", "-"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
