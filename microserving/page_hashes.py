"""The chain of page hashes that names a prompt's full pages: the engine's prefix cache keys its
pages by it (engine_shim/engine/prefix_cache.py) and the router's guess of what each engine
caches (router/prefix_index.py) keys its pages the same way."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

_PAGES_PER_BLOCK = 32  # pages whose ids chain_hashes converts to bytes at once
_EMPTY_HASH = hashlib.blake2b(digest_size=16)


def chain_hashes(
    token_ids: Sequence[int], page_size: int, num_pages: int, salt: str = ""
) -> Iterator[bytes]:
    """Hash of page i covers tokens[0 : (i+1)*page_size], so equal hashes mean equal prefixes
    (and equal positions), which is what makes the KV reusable. The chain starts from the
    request's cache salt: prompts under different salts never share a page."""
    prev = hashlib.blake2b(salt.encode(), digest_size=16).digest() if salt else b""
    # The ids become bytes a block of pages at a time, each page a slice of them, hashed from
    # a copy of an empty hasher: an array and a constructor per page took 0.66 against 0.48 ms
    # for 8,176 ids (19 against 13 us for 256) on the development VM, side by side, and a
    # send's match and its release each hash its prompt. A lookup that misses early
    # (acquire_prefix stops there) converts one block, not the whole prompt.
    page_bytes = 8 * page_size
    for first in range(0, num_pages, _PAGES_PER_BLOCK):
        count = min(_PAGES_PER_BLOCK, num_pages - first)
        data = array("q", token_ids[first * page_size : (first + count) * page_size]).tobytes()
        for offset in range(0, count * page_bytes, page_bytes):
            hasher = _EMPTY_HASH.copy()  # a copy is cheaper than a constructor's arguments
            hasher.update(prev)
            hasher.update(data[offset : offset + page_bytes])
            prev = hasher.digest()
            yield prev
