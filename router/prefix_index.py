"""A bounded router-side guess of what each engine's prefix cache holds.

Per engine, an LRU set of page-hash chains: the hash of page k covers every token of pages
0..k, so a prompt's longest cached prefix is found by walking its chain until the first miss.
Memory is bounded by `max_pages_per_engine` hashes per engine (least recently used dropped).
The guess can be wrong (the engine evicts on its own); it only steers placement, never
correctness: prep_recv's prefix_matched_length is the engine's real answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from microserving.page_hashes import chain_hashes


def page_hash_chain(token_ids: Sequence[int], page_size: int, salt: str = "") -> list[bytes]:
    """One digest per full page; digest k depends on tokens [0, (k + 1) * page_size) and on
    the cache salt (prompts of different tenants never look alike): the engine's own chain
    (microserving.page_hashes), 0.39 ms for 8,176 ids on the development VM. A request's
    patterns compute it once (EngineJob.page_chain) and pass it to every lookup and record."""
    return list(chain_hashes(token_ids, page_size, len(token_ids) // page_size, salt))


class PrefixIndex:
    """Page-hash chains per engine address, each engine's set bounded and LRU-ordered."""

    def __init__(self, page_size: int = 16, max_pages_per_engine: int = 65536) -> None:
        if page_size <= 0 or max_pages_per_engine <= 0:
            raise ValueError("page_size and max_pages_per_engine must be positive")
        self.page_size = page_size
        self.max_pages_per_engine = max_pages_per_engine
        self._pages: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, address: str, token_ids: Sequence[int], salt: str = "") -> None:
        """Note that `address` now caches the full pages of `token_ids` (under `salt`)."""
        self.record_chain(address, page_hash_chain(token_ids, self.page_size, salt))

    def record_chain(self, address: str, chain: Sequence[bytes]) -> None:
        """`record` of a prompt whose page_hash_chain the caller has."""
        pages = self._pages.setdefault(address, OrderedDict())
        for digest in chain:
            pages[digest] = None
            pages.move_to_end(digest)
        while len(pages) > self.max_pages_per_engine:
            pages.popitem(last=False)

    def matched_tokens(self, address: str, chain: Sequence[bytes]) -> int:
        """Tokens of the prompt (whose chain is given) that `address` likely caches."""
        pages = self._pages.get(address)
        if not pages:
            return 0
        num_pages = 0
        for digest in chain:
            if digest not in pages:
                break
            pages.move_to_end(digest)
            num_pages += 1
        return num_pages * self.page_size

    def match_all(self, addresses: Sequence[str], token_ids: Sequence[int], salt: str = "") -> dict[str, int]:
        return self.match_chain(addresses, page_hash_chain(token_ids, self.page_size, salt))

    def match_chain(self, addresses: Sequence[str], chain: Sequence[bytes]) -> dict[str, int]:
        """`match_all` of a prompt whose page_hash_chain the caller has."""
        return {address: self.matched_tokens(address, chain) for address in addresses}

    def forget(self, address: str) -> None:
        """Drop an engine (it left, or restarted with an empty cache)."""
        self._pages.pop(address, None)

    def num_pages(self, address: str) -> int:
        return len(self._pages.get(address, ()))
