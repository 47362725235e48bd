"""The direct and relay rows of one stream count side by side (relay/direct tok/s per round,
the added first-token time in raw round trips, CPU per 1,000 tokens by process), and the table
`microserving bench mlc-relay` prints."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from bench.mlc_relay_load import RoundTrips


def _role_sum(cpu: dict[str, float | None], prefix: str) -> float | None:
    values = [v for k, v in cpu.items() if k.startswith(prefix)]
    return None if not values or None in values else sum(v or 0.0 for v in values)


def _cpu(row: dict[str, Any]) -> dict[str, float | None]:
    cpu = row["cpu_ms_per_1k_tokens"]
    return {"engine": _role_sum(cpu, "engine"), "shim": _role_sum(cpu, "shim"),
            "router": cpu.get("router"), "client": row["client_cpu_ms_per_1k_tokens"]}


def _pair_ratios(direct: dict[str, Any], relay: dict[str, Any]) -> list[float]:
    """relay/direct of each round (the two cells of a round ran back to back)."""
    return [r["client_tok_s"] / d["client_tok_s"]
            for d, r in zip(direct["rounds"], relay["rounds"], strict=True) if d["client_tok_s"]]


def compare_rows(pattern: str, rows: list[dict[str, Any]], trips: RoundTrips) -> list[dict[str, Any]]:
    by_key = {(r["pattern"].split("/")[1], r["streams"]): r for r in rows}
    out = []
    for streams in sorted({s for _, s in by_key}):
        direct, relay = by_key[("direct", streams)], by_key[("relay", streams)]
        ratios = _pair_ratios(direct, relay)
        added_ms = (None if direct["ttft_p50_ms"] is None or relay["ttft_p50_ms"] is None
                    else relay["ttft_p50_ms"] - direct["ttft_p50_ms"])
        out.append({
            "pattern": pattern, "streams": streams,
            "nominal_tok_s": direct["nominal_tok_s"],
            "direct_tok_s": direct["client_tok_s"], "relay_tok_s": relay["client_tok_s"],
            "ratio": statistics.median(ratios) if ratios else None,
            "ratio_spread": [min(ratios), max(ratios)] if ratios else None,
            "direct_ttft_p50_ms": direct["ttft_p50_ms"], "relay_ttft_p50_ms": relay["ttft_p50_ms"],
            "ttft_added_ms": added_ms,
            "ttft_added_http_round_trips": None if added_ms is None else added_ms / trips.http_ms,
            "ttft_added_grpc_round_trips": None if added_ms is None else added_ms / trips.grpc_ms,
            "round_trips": asdict(trips),
            "direct_cpu_ms_per_1k_tokens": _cpu(direct), "relay_cpu_ms_per_1k_tokens": _cpu(relay),
            "engine_thread_ms_per_1k_tokens": {
                "direct": _role_sum(direct["engine_thread_ms_per_1k_tokens"], "engine"),
                "relay": _role_sum(relay["engine_thread_ms_per_1k_tokens"], "engine")},
            "machine_busy_cores": {"direct": direct["machine_busy_cores"],
                                   "relay": relay["machine_busy_cores"]},
            "other_busy_cores": {"direct": direct["other_busy_cores"],
                                 "relay": relay["other_busy_cores"]},
            "num_errors": direct["num_errors"] + relay["num_errors"],
            "num_rounds": direct["num_rounds"],
        })
    return out


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(comparisons: list[dict[str, Any]]) -> str:
    head = ["pattern", "streams", "nominal tok/s", "direct tok/s", "relay tok/s", "relay/direct",
            "TTFT p50 direct ms", "TTFT p50 relay ms", "added ms", "added HTTP RTTs",
            "added gRPC RTTs", "CPU direct: engine, client", "CPU relay: engine, shim, router, client",
            "busy cores d/r"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in comparisons:
        spread = c["ratio_spread"]
        ratio = _fmt(c["ratio"], 2) + ("" if not spread or c["num_rounds"] < 2
                                       else f" ({spread[0]:.2f}-{spread[1]:.2f})")
        d, r = c["direct_cpu_ms_per_1k_tokens"], c["relay_cpu_ms_per_1k_tokens"]
        busy = c["machine_busy_cores"]
        cells = [c["pattern"], str(c["streams"]), _fmt(c["nominal_tok_s"]), _fmt(c["direct_tok_s"]),
                 _fmt(c["relay_tok_s"]), ratio, _fmt(c["direct_ttft_p50_ms"], 2),
                 _fmt(c["relay_ttft_p50_ms"], 2), _fmt(c["ttft_added_ms"], 2),
                 _fmt(c["ttft_added_http_round_trips"], 1), _fmt(c["ttft_added_grpc_round_trips"], 1),
                 f"{_fmt(d['engine'], 1)}, {_fmt(d['client'], 1)}",
                 ", ".join(_fmt(r[k], 1) for k in ("engine", "shim", "router", "client")),
                 f"{_fmt(busy['direct'], 2)}/{_fmt(busy['relay'], 2)}"]
        lines.append("| " + " | ".join(cells) + " |")
    trips = comparisons[0]["round_trips"] if comparisons else None
    if trips:
        lines.append(f"\nraw round trips (median): HTTP GET {trips['http_ms']:.3f} ms, "
                     f"gRPC health check {trips['grpc_ms']:.3f} ms")
    return "\n".join(lines)
