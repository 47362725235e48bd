"""Overload as an answer: before a request is placed, the router checks that some engine of
the role can take it now. An engine is full when it already has requests waiting and little of
its KV pool free (from its last status; see is_full). When every candidate is full,
the request waits a bounded few seconds for room (statuses refresh every health interval),
then gets RESOURCE_EXHAUSTED (HTTP 429 with Retry-After at the gateway), instead of queueing
on a full engine until the first-token deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from prometheus_client import Gauge

from microserving.v1 import engine_pb2
from router.endpoint import Endpoint
from router.errors import OverloadedError

# How often a waiting request looks at the engines' statuses again.
_POLL_S = 0.1


def is_full(endpoint: Endpoint, num_tokens: int) -> bool:
    """Full in the engine's last status or the one before: a full pool frees pages for a
    moment whenever a request ends (until the next waiting one takes them), and one such
    snapshot must not let a request through to queue behind the others."""
    return any(_is_full(status, num_tokens) for status in (endpoint.status, endpoint.previous_status))


def _is_full(status: engine_pb2.GetStatusResponse | None, num_tokens: int) -> bool:
    """Requests wait on the engine (admission is first come, first served, so a new one
    waits behind them) and its free pages are below a quarter of the pool or below what this
    prompt needs: the queue is waiting for KV, not for a batch slot."""
    page_size = status.kv_layout.page_size if status is not None else 0
    if status is None or not status.num_waiting_requests or not page_size:
        return False
    needed_pages = num_tokens // page_size + 1
    return status.num_free_kv_pages < max(needed_pages, status.num_total_kv_pages / 4)


async def wait_for_room(candidates: Callable[[], Sequence[Endpoint]], num_tokens: int,
                        max_wait_s: float, waiting: Gauge | None = None) -> None:
    """Returns as soon as a candidate is not full (or there is none: the pattern then says
    which role is missing); raises OverloadedError after `max_wait_s`. `waiting` counts the
    requests inside the wait (never touched when there is room at once)."""
    if _has_room(candidates(), num_tokens):
        return
    if waiting is not None:
        waiting.inc()
    try:
        deadline_s = time.monotonic() + max_wait_s
        while True:
            if time.monotonic() >= deadline_s:
                raise OverloadedError("every engine's KV cache is full; retry later")
            await asyncio.sleep(_POLL_S)
            if _has_room(candidates(), num_tokens):
                return
    finally:
        if waiting is not None:
            waiting.dec()


def _has_room(engines: Sequence[Endpoint], num_tokens: int) -> bool:
    return not engines or not all(is_full(e, num_tokens) for e in engines)


# RoomBackoff's pauses: short at first (a finishing request frees pages at once), then growing.
_FIRST_PAUSE_S = 0.05
_MAX_PAUSE_S = 1.0


class RoomBackoff:
    """The pauses of one request between attempts that found no room for its KV (an engine
    answered RESOURCE_EXHAUSTED, e.g. the PrepRecv of a resume after a preempt, made while the
    requests that preempted it still hold the pool). The full engine is not at fault, so it is
    tried again after a growing pause instead of being left out, up to a bound that starts
    again whenever the request has streamed more tokens."""

    def __init__(self) -> None:
        self._num_streamed = -1
        self._deadline_s = 0.0
        self._pause_s = _FIRST_PAUSE_S

    async def pause(self, num_streamed: int, max_wait_s: float) -> bool:
        """Sleep before the next attempt -> False, without sleeping, once `max_wait_s` has
        passed since the first pause at this `num_streamed`."""
        now_s = time.monotonic()
        if num_streamed != self._num_streamed:
            self._num_streamed, self._deadline_s, self._pause_s = num_streamed, now_s + max_wait_s, _FIRST_PAUSE_S
        if now_s >= self._deadline_s:
            return False
        await asyncio.sleep(min(self._pause_s, self._deadline_s - now_s))
        self._pause_s = min(2 * self._pause_s, _MAX_PAUSE_S)
        return True
