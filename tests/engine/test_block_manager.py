"""The KV page pool's bookkeeping on its own (plain Python, no model): allocation and free,
reference counts of shared pages, the prefix cache (matching, salts, eviction) and running
out of pages."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from engine_shim.engine.block_manager import (
    BlockManager,
    num_pages_for,
    slot_runs,
    slot_segments,
    slots_for_positions,
)
from microserving.page_hashes import chain_hashes

pytestmark = pytest.mark.unit

PAGE_SIZE = 4


def test_allocation_takes_low_page_ids_first_and_release_returns_them() -> None:
    pool = BlockManager(num_pages=8, page_size=PAGE_SIZE, enable_prefix_cache=False)
    first = pool.allocate(3)
    assert first == [0, 1, 2]
    assert pool.num_free_pages == 5
    assert [pool.ref_count(p) for p in first] == [1, 1, 1]
    pool.release(first)
    assert pool.num_free_pages == 8
    assert pool.allocate(2) == [0, 1]  # released pages come back, lowest first


def test_allocating_past_the_free_pages_raises_and_changes_nothing() -> None:
    pool = BlockManager(num_pages=4, page_size=PAGE_SIZE, enable_prefix_cache=False)
    pool.allocate(3)
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(RuntimeError, match="can_allocate"):
        pool.allocate(2)
    assert pool.num_free_pages == 1


def test_a_shared_page_is_free_only_after_its_last_reference_is_dropped() -> None:
    pool = BlockManager(num_pages=4, page_size=PAGE_SIZE, enable_prefix_cache=False)
    pages = pool.allocate(2)
    pool.share(pages)
    assert [pool.ref_count(p) for p in pages] == [2, 2]
    pool.release(pages)
    assert pool.num_free_pages == 2
    pool.release(pages)
    assert pool.num_free_pages == 4


def test_releasing_a_page_more_often_than_acquired_is_an_error() -> None:
    pool = BlockManager(num_pages=2, page_size=PAGE_SIZE, enable_prefix_cache=False)
    pages = pool.allocate(1)
    pool.release(pages)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(pages)


def test_computed_full_pages_are_matched_by_a_later_prompt_with_the_same_prefix() -> None:
    pool = BlockManager(num_pages=8, page_size=PAGE_SIZE, enable_prefix_cache=True)
    tokens = list(range(100, 110))  # 2 full pages and 2 tokens of a third
    pages = pool.allocate(3)
    pool.release(pages, tokens, num_computed_tokens=10)
    assert pool.num_free_pages == 8  # cached pages count as free: they can be evicted
    assert pool.prefix_cache_stats().num_cached_pages == 2  # the partial page is not cached

    matched = pool.acquire_prefix([*tokens[:8], 7, 7, 7], max_tokens=11)
    assert matched == pages[:2]
    assert [pool.ref_count(p) for p in matched] == [1, 1]
    assert pool.num_free_pages == 6  # referenced again: no longer evictable


def test_a_release_hashes_its_prompt_only_when_it_has_a_page_to_offer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sequence served wholly from the cache (a warm RemoteSend) offers nothing on release
    and skips hashing its prompt; one with a page computed past the cached prefix hashes it
    and caches that page, so the whole prompt matches afterwards."""
    from engine_shim.engine import block_manager

    hashed: list[int] = []

    def counting(token_ids, page_size, num_pages, salt=""):  # type: ignore[no-untyped-def]
        hashed.append(num_pages)
        return chain_hashes(token_ids, page_size, num_pages, salt)

    monkeypatch.setattr(block_manager, "chain_hashes", counting)
    pool = BlockManager(num_pages=8, page_size=PAGE_SIZE, enable_prefix_cache=True)
    tokens = list(range(12))
    pool.release(pool.allocate(2), tokens, num_computed_tokens=8)
    assert hashed == [2]
    warm = pool.acquire_prefix(tokens, max_tokens=8)  # both pages from the cache
    hashed.clear()
    pool.release(warm, tokens, num_computed_tokens=8)
    assert hashed == []
    longer = pool.acquire_prefix(tokens, max_tokens=12) + pool.allocate(1)
    hashed.clear()
    pool.release(longer, tokens, num_computed_tokens=12)  # page 2 computed, not cached yet
    assert hashed == [3]  # page 2 offered: the chain up to it
    assert pool.prefix_cache_stats().num_cached_pages == 3
    assert pool.acquire_prefix(tokens, max_tokens=12) == longer


def test_a_prefix_match_stops_at_the_first_differing_page_and_at_max_tokens() -> None:
    pool = BlockManager(num_pages=8, page_size=PAGE_SIZE, enable_prefix_cache=True)
    tokens = list(range(12))
    pool.release(pool.allocate(3), tokens, num_computed_tokens=12)
    differs_in_page_1 = [*tokens[:4], 99, *tokens[5:]]
    assert len(pool.acquire_prefix(differs_in_page_1, max_tokens=12)) == 1
    assert len(pool.acquire_prefix(tokens, max_tokens=7)) == 1  # only whole pages below 7
    assert len(pool.acquire_prefix(tokens, max_tokens=12)) == 3


def test_pages_cached_under_one_salt_are_invisible_under_another() -> None:
    pool = BlockManager(num_pages=4, page_size=PAGE_SIZE, enable_prefix_cache=True)
    tokens = list(range(8))
    pool.release(pool.allocate(2), tokens, num_computed_tokens=8, salt="tenant-a")
    assert pool.acquire_prefix(tokens, max_tokens=8, salt="tenant-b") == []
    assert pool.acquire_prefix(tokens, max_tokens=8) == []
    assert len(pool.acquire_prefix(tokens, max_tokens=8, salt="tenant-a")) == 2


def test_when_no_page_is_unused_the_least_recently_released_cached_page_is_evicted() -> None:
    pool = BlockManager(num_pages=2, page_size=PAGE_SIZE, enable_prefix_cache=True)
    old, new = [0, 1, 2, 3], [4, 5, 6, 7]
    pool.release(pool.allocate(1), old, num_computed_tokens=4)
    pool.release(pool.allocate(1), new, num_computed_tokens=4)
    assert pool.prefix_cache_stats().num_evictable_pages == 2
    pool.allocate(1)  # no never-used page left: evicts the older one
    assert pool.acquire_prefix(old, max_tokens=4) == []
    assert len(pool.acquire_prefix(new, max_tokens=4)) == 1
    assert not pool.can_allocate(1)  # one page in use, the other referenced again


def _recycled_pool() -> tuple[BlockManager, list[list[int]]]:
    """Three sequences' prompt pages, then their decode pages added a step at a time to all
    (interleaved), released into the cache one sequence after another; every never-used
    page then taken."""
    pool = BlockManager(num_pages=16, page_size=PAGE_SIZE, enable_prefix_cache=True)
    tables = [pool.allocate(2) for _ in range(3)]  # [0, 1], [2, 3], [4, 5]
    for _ in range(2):
        for table in tables:
            table += pool.allocate(1)  # 6, 7, 8, then 9, 10, 11
    assert tables == [[0, 1, 6, 9], [2, 3, 7, 10], [4, 5, 8, 11]]
    for seed, table in enumerate(tables):
        pool.release(table, _tokens(seed), num_computed_tokens=4 * PAGE_SIZE)
    assert pool.allocate(4) == [12, 13, 14, 15]
    return pool, tables


def _tokens(seed: int) -> list[int]:
    return [seed] * 4 * PAGE_SIZE


def test_a_recycled_pool_gives_a_prompt_one_run_of_pages_not_the_lru_scatter() -> None:
    """Strict LRU would hand out the first-released sequence's pages [0, 1, 6, 9]: three
    runs, where a KV transfer moves one piece per run. The run from the LRU page goes on
    through the next idle pages instead."""
    pool, _ = _recycled_pool()
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert pool.prefix_cache_stats().num_evictable_pages == 8


def test_a_run_leaves_pages_released_lately_for_their_prefix_hits() -> None:
    """Eight one-page sequences, page 3's released last (the newest eighth of the releases):
    the run from the LRU page stops before it, the next run starts at the next LRU page, and
    page 3 stays cached for its prefix's next hit."""
    pool = BlockManager(num_pages=8, page_size=PAGE_SIZE, enable_prefix_cache=True)
    pages = pool.allocate(8)
    for page in [0, 1, 2, 4, 5, 6, 7, 3]:
        pool.release([pages[page]], _tokens(page)[:PAGE_SIZE], num_computed_tokens=PAGE_SIZE)
    assert pool.allocate(7) == [0, 1, 2, 4, 5, 6, 7]
    assert pool.acquire_prefix(_tokens(3)[:PAGE_SIZE], max_tokens=PAGE_SIZE) == [3]


def test_a_run_never_takes_a_referenced_page() -> None:
    pool, tables = _recycled_pool()
    assert pool.acquire_prefix(_tokens(1), max_tokens=4 * PAGE_SIZE) == tables[1]  # in use again
    assert pool.allocate(4) == [0, 1, 6, 9]
    assert [pool.ref_count(p) for p in tables[1]] == [1, 1, 1, 1]


def test_prefix_queries_are_counted_for_the_hit_rate() -> None:
    pool = BlockManager(num_pages=4, page_size=PAGE_SIZE, enable_prefix_cache=True)
    pool.record_prefix_query(num_query_tokens=10, num_hit_tokens=8)
    pool.record_prefix_query(num_query_tokens=6, num_hit_tokens=0)
    stats = pool.prefix_cache_stats()
    assert (stats.num_queries, stats.num_query_tokens, stats.num_hit_tokens) == (2, 16, 8)


def test_without_a_prefix_cache_nothing_is_matched_and_released_pages_are_plain_free() -> None:
    pool = BlockManager(num_pages=2, page_size=PAGE_SIZE, enable_prefix_cache=False)
    tokens = list(range(8))
    pool.release(pool.allocate(2), tokens, num_computed_tokens=8)
    assert pool.acquire_prefix(tokens, max_tokens=8) == []
    assert pool.prefix_cache_stats().num_cached_pages == 0
    assert pool.num_free_pages == 2


def test_positions_map_to_slots_through_the_block_table() -> None:
    assert num_pages_for(0, 4) == 0 and num_pages_for(4, 4) == 1 and num_pages_for(5, 4) == 2
    slots = slots_for_positions([3, 1], page_size=4, begin=2, end=7)
    assert slots.tolist() == [14, 15, 4, 5, 6]  # positions 2-3 in page 3, 4-6 in page 1
    assert slot_segments(slots) == [(14, 2), (4, 3)]


def test_slots_and_their_runs_match_the_per_position_formula_for_any_window() -> None:
    """The page-at-a-time slots against `table[i // page_size] * page_size + i % page_size`
    position by position, for every window of a table with runs, gaps and a page out of order:
    windows that start and end mid-page, inside one page, empty."""
    table, page_size = [7, 8, 9, 2, 3, 11, 10], 4
    for begin in range(len(table) * page_size + 1):
        for end in range(begin, len(table) * page_size + 1):
            expected = [table[i // page_size] * page_size + i % page_size for i in range(begin, end)]
            slots = slots_for_positions(table, page_size, begin, end)
            assert slots.dtype == np.int64 and slots.tolist() == expected, (begin, end)
            runs: list[tuple[int, int]] = []
            for slot in expected:  # consecutive slots merged, one at a time
                if runs and runs[-1][1] == slot:
                    runs[-1] = (runs[-1][0], slot + 1)
                else:
                    runs.append((slot, slot + 1))
            assert slot_runs(slots) == runs, (begin, end)
            assert slot_segments(slots) == [(a, b - a) for a, b in runs]


def test_pages_taken_into_runs_leave_the_free_heap_no_bigger_than_it_must_be() -> None:
    """A page taken as a run's next page leaves a stale entry in the free heap; entries that
    are never popped (a low page keeps coming back first) are dropped, not kept forever."""
    pool = BlockManager(num_pages=64, page_size=PAGE_SIZE, enable_prefix_cache=False)
    for _ in range(1000):
        pages = pool.allocate(8)  # a run from the lowest page: seven taken out of the heap
        pool.release(pages)
    assert pool.num_free_pages == 64
    assert len(pool._free) <= 2 * 64 + 64  # noqa: SLF001 - the heap's size is the point
    assert pool.allocate(64) == list(range(64))


def test_a_growing_table_continues_its_run_where_the_next_page_is_idle() -> None:
    pool = BlockManager(num_pages=8, page_size=PAGE_SIZE, enable_prefix_cache=False)
    first, second, third = pool.allocate(2), pool.allocate(2), pool.allocate(2)
    pool.release(second)  # free: 2, 3, 6, 7
    assert pool.allocate(1, after=third[-1]) == [6]  # not the lowest free page, 2
    assert pool.allocate(2, after=first[-1]) == [2, 3]  # 2 is idle: first's run goes on
    assert pool.allocate(1, after=7) == [7]  # the pool's last page: from the lowest free


def test_while_unused_pages_serve_an_allocation_no_cached_page_is_taken_for_a_run() -> None:
    """Unused pages enough for the allocation: a cached page right after the run stays cached
    (its prefix keeps its hits), and the run ends there."""
    pool = BlockManager(num_pages=16, page_size=PAGE_SIZE, enable_prefix_cache=True)
    first, second = pool.allocate(1), pool.allocate(1)  # [0], [1]
    pool.release(first)  # not computed: unused again
    pool.release(second, _tokens(5)[:PAGE_SIZE], num_computed_tokens=PAGE_SIZE)  # cached
    assert pool.allocate(2) == [0, 2]
    assert pool.acquire_prefix(_tokens(5)[:PAGE_SIZE], max_tokens=PAGE_SIZE) == [1]


@pytest.mark.parametrize("differs_at_page", [0, 1, 31, 32, 33, 63, 64, 69])
def test_a_long_prefix_matches_up_to_its_first_differing_page_across_hash_blocks(
    differs_at_page: int,
) -> None:
    """chain_hashes turns the ids into bytes some pages at a time (_PAGES_PER_BLOCK): a
    prompt of 70 pages is matched page by page across those blocks, up to the first page that
    differs, and the hashes are the chain the cache is defined by (each page's int64 ids
    hashed after the previous page's hash, from the salt's)."""
    pool = BlockManager(num_pages=80, page_size=PAGE_SIZE, enable_prefix_cache=True)
    tokens = [(7 * i) % 1000 for i in range(70 * PAGE_SIZE)]
    pool.release(pool.allocate(70), tokens, num_computed_tokens=len(tokens), salt="t")
    other = list(tokens)
    other[differs_at_page * PAGE_SIZE + 1] += 1
    matched = pool.acquire_prefix(other, max_tokens=len(other), salt="t")
    assert len(matched) == differs_at_page

    expected = []
    prev = hashlib.blake2b(b"t", digest_size=16).digest()
    for page in range(70):
        ids = tokens[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]
        prev = hashlib.blake2b(prev + struct.pack(f"<{PAGE_SIZE}q", *ids), digest_size=16).digest()
        expected.append(prev)
    assert list(chain_hashes(tokens, PAGE_SIZE, 70, salt="t")) == expected
    assert list(chain_hashes(tuple(tokens), PAGE_SIZE, 70, salt="t")) == expected


def test_dropping_the_cached_prefixes_frees_those_no_sequence_holds() -> None:
    pool = BlockManager(num_pages=8, page_size=PAGE_SIZE, enable_prefix_cache=True)
    tokens, other = list(range(8)), list(range(50, 58))
    pool.release(pool.allocate(2), tokens, num_computed_tokens=8)  # two cached, evictable pages
    held = pool.allocate(2)
    pool.share(held)  # a second holder: still referenced after the release below
    pool.release(held, other, num_computed_tokens=8)  # cached, in use
    assert pool.prefix_cache_stats().num_cached_pages == 4
    assert pool.drop_cached_prefixes() == 2
    assert pool.num_free_pages == 6  # nothing lost: the dropped pages are unused now
    assert pool.acquire_prefix(tokens, max_tokens=8) == []  # no hit on what was dropped
    assert len(pool.acquire_prefix(other, max_tokens=8)) == 2  # what a sequence holds stays
    assert pool.prefix_cache_stats().num_cached_pages == 2
