"""Length distributions written as short strings: `3000`, `normal:3000,300`, `uniform:100,200`.

Samples are integers >= 1 drawn from a caller-seeded random.Random, so a workload is
reproducible from its seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("const", "normal", "uniform")


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts. const: a; normal: mean a, std b; uniform: [a, b]."""

    kind: str
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "const":
            value = self.a
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = rng.uniform(self.a, self.b)
        return max(1, round(value))

    @property
    def mean(self) -> float:
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    def __str__(self) -> str:
        if self.kind == "const":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g},{self.b:g}"


def parse_length_dist(text: str) -> LengthDist:
    """Parse `N`, `normal:MEAN,STD` or `uniform:LOW,HIGH`; ValueError with a plain message."""
    kind, sep, rest = text.strip().partition(":")
    try:
        if not sep:
            dist = LengthDist("const", float(kind))
        else:
            low_text, _, high_text = rest.partition(",")
            dist = LengthDist(kind, float(low_text), float(high_text))
    except ValueError:
        raise ValueError(
            f"bad length distribution {text!r}: use N, normal:MEAN,STD or uniform:LOW,HIGH"
        ) from None
    _check(dist, text)
    return dist


def _check(dist: LengthDist, text: str) -> None:
    if dist.kind not in KINDS:
        raise ValueError(f"bad length distribution {text!r}: unknown kind {dist.kind!r}")
    if dist.a < 1:
        raise ValueError(f"bad length distribution {text!r}: lengths must be >= 1")
    if dist.kind == "normal" and dist.b < 0:
        raise ValueError(f"bad length distribution {text!r}: std must be >= 0")
    if dist.kind == "uniform" and dist.b < dist.a:
        raise ValueError(f"bad length distribution {text!r}: HIGH must be >= LOW")
