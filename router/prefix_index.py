"""A bounded router-side guess of what each engine's prefix cache holds.

Per engine, an LRU set of page-hash chains: the hash of page k covers every token of pages
0..k, so a prompt's longest cached prefix is found by walking its chain until the first miss.
Memory is bounded by `max_pages_per_engine` hashes per engine (least recently used dropped).
The guess can be wrong (the engine evicts on its own); it only steers placement, never
correctness: prep_recv's prefix_matched_length is the engine's real answer.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def page_hash_chain(token_ids: Sequence[int], page_size: int, salt: str = "") -> list[bytes]:
    """One digest per full page; digest k depends on tokens [0, (k + 1) * page_size) and on
    the cache salt (prompts of different tenants never look alike)."""
    chain: list[bytes] = []
    previous = hashlib.blake2b(salt.encode(), digest_size=16).digest() if salt else b""
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = array("i", token_ids[start : start + page_size]).tobytes()
        previous = hashlib.blake2b(previous + page, digest_size=16).digest()
        chain.append(previous)
    return chain


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
        pages = self._pages.setdefault(address, OrderedDict())
        for digest in page_hash_chain(token_ids, self.page_size, salt):
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
        chain = page_hash_chain(token_ids, self.page_size, salt)
        return {address: self.matched_tokens(address, chain) for address in addresses}

    def forget(self, address: str) -> None:
        """Drop an engine (it left, or restarted with an empty cache)."""
        self._pages.pop(address, None)

    def num_pages(self, address: str) -> int:
        return len(self._pages.get(address, ()))
