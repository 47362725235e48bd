"""The KV page pool's bookkeeping: free pages, reference counts, and the prefix cache.

A page id p owns slots [p * page_size, (p + 1) * page_size) of the KV tensors. A sequence's
block table lists its pages in position order, so position i lives at slot
`table[i // page_size] * page_size + i % page_size`. No torch; slots are numpy arrays.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from microserving.page_hashes import chain_hashes

from .api import PrefixCacheStats
from .prefix_cache import PrefixCache


def num_pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


Slots = npt.NDArray[np.int64]


def slots_for_positions(
    block_table: Sequence[int], page_size: int, begin: int, end: int
) -> Slots:
    """The slots of positions [begin, end), in position order, as int64. Built a page at a
    time with numpy: a send's or a reservation's 8,176 positions took 0.67 ms as a
    per-position list comprehension and 0.03 ms so (development VM), on the engine core's
    loop for every RemoteSend, PrepRecv and KV import."""
    if end <= begin:
        return np.empty(0, dtype=np.int64)
    first = begin // page_size
    pages = np.asarray(block_table[first : (end - 1) // page_size + 1], dtype=np.int64)
    slots = (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).ravel()
    offset = begin - first * page_size
    return slots[offset : offset + end - begin]


def slot_runs(slots: Sequence[int] | Slots) -> list[tuple[int, int]]:
    """[start, stop) ranges of consecutive slots, in order: [4, 5, 6, 9] -> [(4, 7), (9, 10)]."""
    array = np.asarray(slots, dtype=np.int64)
    if not len(array):
        return []
    breaks = np.flatnonzero(np.diff(array) != 1) + 1
    starts = array[np.concatenate(([0], breaks))]
    stops = array[np.concatenate((breaks - 1, [len(array) - 1]))] + 1
    return list(zip(starts.tolist(), stops.tolist(), strict=True))


def slot_segments(slots: Sequence[int] | Slots) -> list[tuple[int, int]]:
    """Merge slots into (begin, length) runs of consecutive slots, MLC's kv_append_metadata."""
    return [(start, stop - start) for start, stop in slot_runs(slots)]


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool) -> None:
        self.num_total_pages = num_pages
        self.page_size = page_size
        # Unused pages: a min-heap (low ids first, so fresh allocations tend to be contiguous
        # slot runs) whose entries count only while in the set (a page taken out of order,
        # as a run's next page, leaves a stale entry that its pop skips).
        self._free: list[int] = list(range(num_pages))
        heapq.heapify(self._free)
        self._free_set: set[int] = set(self._free)
        self._ref_counts = [0] * num_pages
        self._cache = PrefixCache() if enable_prefix_cache else None

    # ---- capacity ----
    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can get now: never used plus evictable cached pages."""
        evictable = self._cache.num_evictable_pages if self._cache else 0
        return len(self._free_set) + evictable

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    def allocate(self, num_pages: int, after: int | None = None) -> list[int]:
        """`num_pages` pages, in runs (below); `after`: the last page of the table they
        extend, whose run goes on first where the pages after it are idle."""
        if not self.can_allocate(num_pages):
            raise RuntimeError("allocate() beyond num_free_pages; call can_allocate first")
        pages: list[int] = []
        # A run goes on through the next pages while they are idle, even out of LRU order:
        # once a long-running pool has recycled its pages, strict LRU handed a prompt's pages
        # out one from here, one from there (decode steps add pages to many requests at once,
        # interleaved), and a KV transfer of the prompt moves one piece per run and KV plane
        # (a NIXL write of 255 tokens: 32 descriptors on a fresh pool, up to 512 on a
        # recycled one). Idle: unused; or cached and evictable, but only once unused pages
        # are scarce (fewer than the allocation needs, or than a sixteenth of the pool: a
        # recycled pool's unused pages are the scattered partial last pages of finished
        # requests) and never among the newest eighth of the releases, so that a pool with
        # room, and a prefix released lately, keep their hits.
        scarce = len(self._free_set) < max(num_pages, self.num_total_pages // 16)
        released_by = self._cache.out_of_order_bound() if self._cache is not None and scarce else -1
        page = -1 if after is None else after + 1  # the page a run would take next
        while len(pages) < num_pages:
            if not (0 <= page < self.num_total_pages and self._take_if_idle(page, released_by)):
                page = self._take_one()  # a new run
            pages.append(page)
            page += 1
        for page in pages:
            self._ref_counts[page] = 1
        return pages

    def _take_one(self) -> int:
        while self._free:
            page = heapq.heappop(self._free)
            if page in self._free_set:
                self._free_set.remove(page)
                return page
        if self._cache is None:
            raise RuntimeError("no free page")
        evicted = self._cache.evict_lru()
        if evicted is None:
            raise RuntimeError("no free page")
        return evicted

    def _take_if_idle(self, page: int, released_by: int) -> bool:
        """Take `page` if nothing references it: unused, or cached, evictable and released at
        or before `released_by` (PrefixCache.evict)."""
        if self._ref_counts[page]:
            return False
        if page in self._free_set:
            self._free_set.remove(page)  # its heap entry goes stale
            if len(self._free) > 2 * len(self._free_set) + 64:  # stale entries never popped
                self._free = list(self._free_set)
                heapq.heapify(self._free)
            return True
        return self._cache is not None and self._cache.evict(page, released_by)

    # ---- sharing ----
    def acquire_prefix(self, token_ids: Sequence[int], max_tokens: int, salt: str = "") -> list[int]:
        """Take references on the cached pages holding the longest page-aligned prefix of
        token_ids[:max_tokens]; returns those pages (matched tokens = len * page_size)."""
        if self._cache is None:
            return []
        pages: list[int] = []
        num_full = max_tokens // self.page_size
        for page_hash in chain_hashes(token_ids, self.page_size, num_full, salt):
            page = self._cache.lookup(page_hash)
            if page is None:
                break
            pages.append(page)
        self.share(pages)
        return pages

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        if self._cache is not None:
            self._cache.record_query(num_query_tokens, num_hit_tokens)

    def share(self, pages: Sequence[int]) -> None:
        for page in pages:
            if self._ref_counts[page] == 0 and self._cache is not None:
                self._cache.mark_in_use(page)
            self._ref_counts[page] += 1

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    # ---- release ----
    def release(
        self, block_table: Sequence[int], token_ids: Sequence[int] = (), num_computed_tokens: int = 0,
        salt: str = "",
    ) -> None:
        """Drop one reference on every page of a sequence. Full pages whose KV is computed for
        token_ids[:num_computed_tokens] are first offered to the prefix cache."""
        if self._cache is not None and num_computed_tokens >= self.page_size:
            self._register(block_table, token_ids, num_computed_tokens, salt)
        for page in block_table:
            self._drop_ref(page)

    def _register(
        self, block_table: Sequence[int], token_ids: Sequence[int], num_computed_tokens: int, salt: str
    ) -> None:
        cache = self._cache
        if cache is None:
            return
        num_full = min(num_computed_tokens // self.page_size, len(block_table))
        if all(map(cache.is_cached, block_table[:num_full])):
            # Nothing to offer (a send or a request served from the cache): its prompt is not
            # hashed again, 0.42 ms for 8,176 ids on the development VM.
            return
        for page, page_hash in zip(
            block_table, chain_hashes(token_ids, self.page_size, num_full, salt), strict=False
        ):
            if not cache.is_cached(page):
                cache.insert(page_hash, page)

    def _drop_ref(self, page: int) -> None:
        if self._ref_counts[page] <= 0:
            raise RuntimeError(f"page {page} released more often than acquired")
        self._ref_counts[page] -= 1
        if self._ref_counts[page] > 0:
            return
        if self._cache is not None and self._cache.is_cached(page):
            self._cache.mark_evictable(page)
        else:
            self._put_unused(page)

    def _put_unused(self, page: int) -> None:
        """`page` joins the unused pages (the heap and the set _take_one keeps together)."""
        heapq.heappush(self._free, page)
        self._free_set.add(page)

    def drop_cached_prefixes(self) -> int:
        """Forget every cached page that no sequence references: they become unused pages,
        and no later prompt hits them; the count. Pages in use keep their hashes."""
        if self._cache is None:
            return 0
        dropped = 0
        while (page := self._cache.evict_lru()) is not None:
            self._put_unused(page)
            dropped += 1
        return dropped

    def prefix_cache_stats(self) -> PrefixCacheStats:
        if self._cache is None:
            return PrefixCacheStats(0, 0, 0, 0, 0)
        return self._cache.stats()
