"""A start that waited in the engine for its KV (after_kv) and ran to its end retires its
receive ticket: closed at once when the push into it had finished, or as the push finishes
when the request ended first (a one- or two-token request can end before the receiving
side's last steps: its hold released, then the table's finish). Left open, a ticket stays
until its TTL and every later PrepRecv scans it (ReceiveTable.open sweeps the table).
A start that failed or was cancelled leaves the ticket to its owner (an abort, the push's
own ending, the TTL), as before. The engine is a stand-in: what is tested is the shim's
bookkeeping; tests/e2e/test_e2e_metrics.py watches the same through a real stack."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine_shim.backends.embedded.backend import EmbeddedBackend
from engine_shim.engine.api import SamplingParams
from engine_shim.settings import ShimSettings

pytestmark = pytest.mark.unit


class _Engine:
    """run_generate as AsyncEngine's: returns once the request has finished (or raises)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    async def run_generate(self, request_id: str, *args: Any) -> None:
        await asyncio.sleep(0)
        if self.error is not None:
            raise self.error


def _backend(engine: _Engine) -> EmbeddedBackend:
    backend = EmbeddedBackend(ShimSettings(port=0))
    backend._engine = engine  # type: ignore[assignment]
    return backend


async def _start(backend: EmbeddedBackend, request_id: str) -> None:
    await backend.run_generate(request_id, [1, 2, 3], 3, SamplingParams(), lambda _: None, after_kv=True)


def test_a_request_that_ends_while_its_push_finishes_closes_the_ticket_with_the_push() -> None:
    async def scenario() -> None:
        backend = _backend(_Engine())
        table = backend._table
        ticket = table.open("short", 0, 3)
        table.claim("short", ticket.token)  # the push is in progress ...
        await _start(backend, "short")  # ... when the request has already ended
        assert table.get("short") is ticket  # still the push's to finish
        table.finish(ticket)
        await asyncio.sleep(0)  # the fill's callbacks
        assert table.get("short") is None and len(table) == 0

    asyncio.run(scenario())


def test_a_request_that_ends_after_its_push_closes_the_ticket_at_once() -> None:
    async def scenario() -> None:
        backend = _backend(_Engine())
        table = backend._table
        ticket = table.open("filled", 0, 3)
        table.claim("filled", ticket.token)
        table.finish(ticket)  # pushed; the start has not taken it yet
        assert table.get("filled") is ticket
        await _start(backend, "filled")
        assert len(table) == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("error", [RuntimeError("engine failed"), asyncio.CancelledError()])
def test_a_start_that_did_not_run_to_its_end_leaves_the_ticket_to_its_owner(error: BaseException) -> None:
    """A failed or cancelled start retires nothing: its ticket may yet serve the push that
    is filling it (an abort or the TTL ends it)."""
    async def scenario() -> None:
        backend = _backend(_Engine(error))
        table = backend._table
        ticket = table.open("failed", 0, 3)
        table.claim("failed", ticket.token)
        with pytest.raises(type(error)):
            await _start(backend, "failed")
        table.finish(ticket)
        await asyncio.sleep(0)
        assert table.get("failed") is ticket

    asyncio.run(scenario())


def test_a_later_reservation_under_the_same_id_is_not_retired() -> None:
    """The ticket retired is the one the start waited on: one opened since under the same
    id (a new PrepRecv) stays."""
    async def scenario() -> None:
        backend = _backend(_Engine())
        table = backend._table
        first = table.open("again", 0, 3)
        table.claim("again", first.token)
        await _start(backend, "again")
        second = table.open("again", 0, 3)  # closes the first, as PrepRecv does
        table.finish(first)
        await asyncio.sleep(0)
        assert table.get("again") is second

    asyncio.run(scenario())
