"""BENCHMARK ONLY. The GPU schedule the synthetic engine keeps: a decode step time that depends
on the batch size (linear between measured points, flat past the ends) and a prefill rate.
Plain Python, no torch: the capacity benchmark computes its nominal rates from it too."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

# llama-1b on one H200, bf16, chained decode steps (docs/gpu.md); prefill about 120k tok/s.
DEFAULT_STEP_MS = "1:1.03,32:1.33,128:2.01"
DEFAULT_PREFILL_TOK_S = 120_000.0


@dataclass(frozen=True)
class StepProfile:
    """`points`: (batch size, decode step seconds), batch sizes strictly increasing."""

    points: tuple[tuple[int, float], ...]
    prefill_tok_s: float = DEFAULT_PREFILL_TOK_S

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a step profile needs at least one point")
        sizes = [size for size, _ in self.points]
        if sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError("step profile batch sizes must be >= 1 and strictly increasing")
        if any(not step_s > 0 for _, step_s in self.points):
            raise ValueError("step profile times must be > 0")
        if not self.prefill_tok_s > 0:
            raise ValueError("prefill rate must be > 0")

    @classmethod
    def parse(cls, step_ms: str, prefill_tok_s: float = DEFAULT_PREFILL_TOK_S) -> StepProfile:
        """`"1:1.03,32:1.33,128:2.01"`: batch size : decode step milliseconds."""
        points = []
        for item in step_ms.split(","):
            size, sep, ms = item.strip().partition(":")
            try:
                if not sep:
                    raise ValueError
                points.append((int(size), float(ms) / 1e3))
            except ValueError:
                raise ValueError(
                    f"bad step profile item {item!r}: want BATCH:MS, e.g. 1:1.03,32:1.33"
                ) from None
        return cls(tuple(points), prefill_tok_s)

    def decode_step_s(self, batch_size: int) -> float:
        """Step time of `batch_size` rows, interpolated; 0 rows take no time."""
        if batch_size <= 0:
            return 0.0
        sizes = [size for size, _ in self.points]
        i = bisect_left(sizes, batch_size)
        if i == 0:
            return self.points[0][1]
        if i == len(sizes):
            return self.points[-1][1]
        (lo, lo_s), (hi, hi_s) = self.points[i - 1], self.points[i]
        return lo_s + (hi_s - lo_s) * (batch_size - lo) / (hi - lo)

    def step_s(self, batch_size: int, num_prefill_tokens: int) -> float:
        """A step of `batch_size` rows that also computes `num_prefill_tokens` prompt tokens."""
        return self.decode_step_s(batch_size) + num_prefill_tokens / self.prefill_tok_s

    def describe(self) -> str:
        points = ",".join(f"{size}:{step_s * 1e3:g}" for size, step_s in self.points)
        return f"step ms {points}, prefill {self.prefill_tok_s:g} tok/s"
