"""The stage deadline of a decode, one timer for both ways the router decodes (a StartGenerate
call, a request on an engine's multiplexed stream): the first output must come within
first_token_timeout_s of the start, each next one within inter_token_timeout_s of the one
before. Only time spent waiting counts (`waiting()` .. `arrived()`): a consumer busy between
reads is not the engine's fault.

One timer per decode, not one per message: marking costs two assignments, and the timer
re-arms itself only when it fires early (or the limit shrinks after the first output)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class StageDeadline:
    def __init__(self, first_limit_s: float, next_limit_s: float, on_expiry: Callable[[], object]) -> None:
        self._loop = asyncio.get_running_loop()
        self._limit_s = first_limit_s
        self._next_limit_s = next_limit_s
        self._on_expiry = on_expiry
        self._waiting_since: float | None = None
        self.has_expired = False
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(first_limit_s, self._check)

    def waiting(self) -> None:
        """The decode waits for its next output from now."""
        self._waiting_since = self._loop.time()

    def arrived(self) -> None:
        """An output arrived: the clock stops, and later outputs get the inter-token limit."""
        self._waiting_since = None
        if self._next_limit_s != self._limit_s:  # once per decode: first-token -> inter-token
            self._limit_s = self._next_limit_s
            self.stop()
            self._timer = self._loop.call_later(self._limit_s, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        now = self._loop.time()
        since = self._waiting_since
        if since is not None and now - since >= self._limit_s:
            self.has_expired = True
            self._timer = None
            self._on_expiry()
            return
        self._timer = self._loop.call_at((since if since is not None else now) + self._limit_s, self._check)
