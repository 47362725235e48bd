"""Page-granular prefix cache: maps the chain hash of every full page of tokens to the page
that holds its KV. Pages here may be referenced (in use by a sequence) or evictable (ref
count 0, kept in LRU order until the pool needs them); the hashes are
microserving.page_hashes'. Plain Python, no torch."""

from __future__ import annotations

from collections import OrderedDict

from .api import PrefixCacheStats


class PrefixCache:
    def __init__(self) -> None:
        self._page_by_hash: dict[bytes, int] = {}
        self._hash_by_page: dict[int, bytes] = {}
        # Evictable pages, LRU first, each with the count of releases when it was released.
        self._evictable: OrderedDict[int, int] = OrderedDict()
        self._num_releases = 0
        self.num_queries = 0
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_cached_pages(self) -> int:
        return len(self._hash_by_page)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    def lookup(self, page_hash: bytes) -> int | None:
        return self._page_by_hash.get(page_hash)

    def is_cached(self, page: int) -> bool:
        return page in self._hash_by_page

    def insert(self, page_hash: bytes, page: int) -> bool:
        """Register a full page; False if the hash (or the page) is already cached."""
        if page_hash in self._page_by_hash or page in self._hash_by_page:
            return False
        self._page_by_hash[page_hash] = page
        self._hash_by_page[page] = page_hash
        return True

    def mark_evictable(self, page: int) -> None:
        self._num_releases += 1
        self._evictable[page] = self._num_releases
        self._evictable.move_to_end(page)

    def mark_in_use(self, page: int) -> None:
        self._evictable.pop(page, None)

    def evict_lru(self) -> int | None:
        """Forget the least recently released unreferenced page and return it for reuse."""
        if not self._evictable:
            return None
        page, _ = self._evictable.popitem(last=False)
        self._forget(page)
        return page

    def out_of_order_bound(self) -> int:
        """The release count at or below which evict() may take an evictable page out of LRU
        order: all but the newest eighth of the evictable pages' releases."""
        if not self._evictable:
            return 0
        oldest = next(iter(self._evictable.values()))
        return oldest + (self._num_releases - oldest) * 7 // 8

    def evict(self, page: int, released_by: int) -> bool:
        """Forget `page` if it is evictable and was released at or before `released_by` (out
        of LRU order: a run's next page; a page released lately, say a shared prefix's, is
        left for its next hit); whether it was."""
        if self._evictable.get(page, released_by + 1) > released_by:
            return False
        del self._evictable[page]
        self._forget(page)
        return True

    def _forget(self, page: int) -> None:
        del self._page_by_hash[self._hash_by_page.pop(page)]

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_queries += 1
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            num_queries=self.num_queries,
            num_query_tokens=self.num_query_tokens,
            num_hit_tokens=self.num_hit_tokens,
            num_cached_pages=self.num_cached_pages,
            num_evictable_pages=self.num_evictable_pages,
        )
