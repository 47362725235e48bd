"""Summary statistics of a run: latency percentiles, throughput and errors."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.loadgen.client import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of a non-empty sequence."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe(values: Sequence[float]) -> dict[str, float] | None:
    """mean, std, min, max and p50/p90/p99 in the values' unit; None for no values."""
    if not values:
        return None
    summary = {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "min": min(values),
        "max": max(values),
    }
    summary.update({f"p{p}": percentile(values, p) for p in PERCENTILES})
    return summary


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """The figures a run reports. Latencies in seconds; throughput over the measured phase."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return {
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_errors": len(failed),
        "error_kinds": dict(Counter(r.error or "" for r in failed)),
        "duration_s": duration_s,
        "requests_per_s": per_s(len(ok)),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_tokens_per_s": per_s(input_tokens),
        "output_tokens_per_s": per_s(output_tokens),
        "ttft_s": describe([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": describe([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_s": describe([gap for r in ok for gap in r.itls_s]),
        "jct_s": describe([r.jct_s for r in ok]),
    }
