"""Pure placement policies: MLC's balance formula, least-loaded and cache-aware choice, the
adaptive split, and the bounded prefix index."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from router.policies import (
    AdaptivePolicy,
    adaptive_split,
    balanced_end,
    normalise_end,
    pick_cache_aware,
    pick_least_loaded,
)
from router.prefix_index import PrefixIndex, page_hash_chain


@dataclass
class FakeEngine:
    address: str
    load: float


@pytest.mark.parametrize(
    ("factor", "length", "end"),
    [(0.0, 100, -1), (1e-6, 100, -1), (0.1, 100, 90), (0.5, 101, 50), (0.1, 7, 6), (0.99, 10, 0)],
)
def test_balanced_end_is_mlc_formula(factor: float, length: int, end: int) -> None:
    assert balanced_end(factor, length) == end


def test_normalise_end_counts_negative_from_the_end() -> None:
    assert normalise_end(-1, 10) == 9 and normalise_end(4, 10) == 4


def test_least_loaded_wins_and_ties_rotate() -> None:
    engines = [FakeEngine("a", 2), FakeEngine("b", 0), FakeEngine("c", 0)]
    assert pick_least_loaded(engines, 0).address == "b"
    assert pick_least_loaded(engines, 1).address == "c"
    assert pick_least_loaded([], 0) is None


def test_cache_aware_prefers_longest_prefix_unless_too_busy() -> None:
    engines = [FakeEngine("a", 0), FakeEngine("b", 3)]
    matched = {"a": 0, "b": 64}
    chosen = pick_cache_aware(engines, matched, 0, min_match_tokens=16, max_extra_load=4)
    assert chosen.address == "b"
    too_busy = pick_cache_aware(engines, matched, 0, min_match_tokens=16, max_extra_load=2)
    assert too_busy.address == "a"
    short = pick_cache_aware(engines, {"b": 8}, 0, min_match_tokens=16, max_extra_load=4)
    assert short.address == "a"


def test_adaptive_skips_prefill_for_short_uncached_part() -> None:
    policy = AdaptivePolicy(min_remote_tokens=32)
    decision = adaptive_split(policy, num_prompt_tokens=100, num_cached_tokens=80, prefill_load=0, decode_load=0)
    assert decision.skip_prefill


def test_adaptive_skips_prefill_when_it_is_the_bottleneck() -> None:
    policy = AdaptivePolicy(max_prefill_load_ratio=4.0)
    decision = adaptive_split(policy, num_prompt_tokens=500, num_cached_tokens=0, prefill_load=20, decode_load=1)
    assert decision.skip_prefill


def test_adaptive_factor_grows_with_prefill_load_and_stays_bounded() -> None:
    policy = AdaptivePolicy(max_factor=0.5)
    factors = [
        adaptive_split(policy, num_prompt_tokens=500, num_cached_tokens=0, prefill_load=p, decode_load=2).pd_balance_factor
        for p in (0, 2, 4, 6)
    ]
    assert factors[0] == 0.0 and factors[1] == 0.0  # P no busier than D: all prefill on P
    assert 0.0 < factors[2] < factors[3] <= 0.5


def test_page_hash_chain_depends_on_whole_prefix() -> None:
    a = page_hash_chain(list(range(48)), 16)
    b = page_hash_chain([99, *range(1, 48)], 16)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b, strict=True))
    assert page_hash_chain(list(range(15)), 16) == []


def test_prefix_index_matches_longest_recorded_prefix() -> None:
    index = PrefixIndex(page_size=4, max_pages_per_engine=100)
    index.record("e1", list(range(12)))
    assert index.match_all(["e1", "e2"], [*range(8), 50, 51, 52, 53]) == {"e1": 8, "e2": 0}
    index.forget("e1")
    assert index.match_all(["e1"], list(range(12))) == {"e1": 0}


def test_prefix_index_memory_is_bounded_lru() -> None:
    index = PrefixIndex(page_size=2, max_pages_per_engine=3)
    index.record("e", [1, 2, 3, 4])  # 2 pages
    index.record("e", [9, 9, 8, 8])  # 2 more: the oldest page is dropped
    assert index.num_pages("e") == 3
    assert index.match_all(["e"], [1, 2, 3, 4])["e"] == 0  # first page evicted: chain broken
    assert index.match_all(["e"], [9, 9, 8, 8])["e"] == 4
