"""BENCHMARK ONLY. The synthetic engine's KV pool: a count of fake pages. A holder's page list
only says how many it has (no tensors behind them), so admission and KV-pool limits behave
as in the real engine at no cost."""

from __future__ import annotations

from engine_shim.engine.api import ResourceExhaustedError

DEFAULT_NUM_PAGES = 1 << 16  # pages are only counted, so a large pool costs nothing


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_free_pages = num_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def grow(self, pages: list[int], num_tokens: int) -> bool:
        """Extend `pages` to cover `num_tokens`; False (and no change) if the pool is short."""
        missing = self.pages_for(num_tokens) - len(pages)
        if missing <= 0:
            return True
        if missing > self.num_free_pages:
            return False
        self.num_free_pages -= missing
        pages.extend([0] * missing)
        return True

    def release(self, pages: list[int]) -> None:
        self.num_free_pages += len(pages)
        pages.clear()

    def check_fits(self, num_tokens: int) -> None:
        """A request this long could never run, however empty the pool."""
        if self.pages_for(num_tokens) > self.num_pages:
            raise ResourceExhaustedError(
                f"{num_tokens} tokens need more KV pages than the pool holds ({self.num_pages})"
            )
