"""Pure placement policies: least-loaded choice, MLC's balance formula and the adaptive split.

No I/O and no gRPC: every function takes numbers (or small views of engines) and returns a
decision, so each one is unit-tested on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# |f| below this counts as 0 (MLC's threshold).
BALANCE_EPSILON = 1e-5


class Loaded(Protocol):
    """What least-loaded choice needs of an engine."""

    @property
    def address(self) -> str: ...

    @property
    def load(self) -> float: ...


def balanced_end(pd_balance_factor: float, num_prompt_tokens: int) -> int:
    """MLC's window end for balanced PD: the decode engine prefills prompt[end:].

    end = -1 (all but the last token) when |f| < 1e-5, else int((1 - f) * len(prompt)).
    """
    if abs(pd_balance_factor) < BALANCE_EPSILON:
        return -1
    return int((1 - pd_balance_factor) * num_prompt_tokens)


def normalise_end(end: int, num_prompt_tokens: int) -> int:
    """A Python-style (possibly negative) window end as a non-negative index."""
    return end + num_prompt_tokens if end < 0 else end


def pick_least_loaded(candidates: Sequence[Loaded], turn: int) -> Loaded | None:
    """The least-loaded candidate; ties are broken by rotating over them with `turn` so equal
    engines share work (round-robin among the least loaded)."""
    if not candidates:
        return None
    lowest = min(c.load for c in candidates)
    tied = [c for c in candidates if c.load <= lowest]
    return tied[turn % len(tied)]


def pick_cache_aware(
    candidates: Sequence[Loaded],
    matched_tokens: dict[str, int],
    turn: int,
    *,
    min_match_tokens: int,
    max_extra_load: float,
) -> Loaded | None:
    """The candidate whose prefix cache holds the longest prefix of the prompt, unless that
    engine is more than `max_extra_load` busier than the least loaded; else least loaded."""
    if not candidates:
        return None
    lowest = min(c.load for c in candidates)
    eligible = [
        c for c in candidates
        if matched_tokens.get(c.address, 0) >= min_match_tokens and c.load <= lowest + max_extra_load
    ]
    if not eligible:
        return pick_least_loaded(candidates, turn)
    best = max(matched_tokens.get(c.address, 0) for c in eligible)
    longest = [c for c in eligible if matched_tokens.get(c.address, 0) == best]
    return pick_least_loaded(longest, turn)


@dataclass(frozen=True)
class AdaptivePolicy:
    """How adaptive-disagg chooses a split per request (see docs/router.md).

    min_remote_tokens: below this many uncached prompt tokens the decode engine prefills the
        whole prompt itself (a KV transfer would cost more than it saves).
    max_prefill_load_ratio: when the least-loaded prefill engine carries more than this many
        times the decode engine's load, P is the bottleneck and is skipped.
    base_factor: the split when P and D are equally loaded.
    max_factor: the largest fraction the decode engine ever prefills in a split.
    """

    min_remote_tokens: int = 32
    max_prefill_load_ratio: float = 4.0
    base_factor: float = 0.0
    max_factor: float = 0.5


@dataclass(frozen=True)
class AdaptiveDecision:
    """skip_prefill: run the request on D alone (start_generate from the cached prefix);
    otherwise D prefills the last `pd_balance_factor` of the prompt."""

    skip_prefill: bool
    pd_balance_factor: float


def adaptive_split(
    policy: AdaptivePolicy,
    *,
    num_prompt_tokens: int,
    num_cached_tokens: int,
    prefill_load: float,
    decode_load: float,
) -> AdaptiveDecision:
    """Choose the split of one request from measured load.

    The factor moves from base_factor towards max_factor as P gets busier than D:
    f = base + (max - base) * p / (p + d) when p > d, else base; p and d are the loads of the
    least-loaded P and D engines (in-flight requests, 1 added so idle engines compare).
    """
    uncached = num_prompt_tokens - num_cached_tokens
    if uncached < policy.min_remote_tokens:
        return AdaptiveDecision(skip_prefill=True, pd_balance_factor=0.0)
    p, d = prefill_load + 1.0, decode_load + 1.0
    if p > policy.max_prefill_load_ratio * d:
        return AdaptiveDecision(skip_prefill=True, pd_balance_factor=0.0)
    factor = policy.base_factor
    if p > d:
        factor += (policy.max_factor - policy.base_factor) * p / (p + d)
    factor = min(max(factor, 0.0), policy.max_factor)
    return AdaptiveDecision(skip_prefill=False, pd_balance_factor=factor)
