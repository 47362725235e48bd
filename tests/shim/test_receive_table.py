"""The receiver's reservation table owns the TTL of reservations its engine holds with none
(prep_recv(held=True), where NIXL writes may come): an engine-held ticket that expires is
reported once, whether a sweep or a later lookup finds it; one that is consumed, aborted,
filled or held is not; and a finished write hands the TTL back to the engine."""

from __future__ import annotations

import asyncio
import types

import pytest

from engine_shim.backends.embedded.kv_plane import reservations
from engine_shim.backends.embedded.kv_plane.reservations import ReceiveTable
from engine_shim.engine.api import FailedPreconditionError, NotFoundError

pytestmark = pytest.mark.unit

TTL_S = 30.0
_now = [1000.0]  # the table's clock, moved by the tests only (a loaded machine cannot move it)


@pytest.fixture(autouse=True)
def _clock(monkeypatch: pytest.MonkeyPatch) -> None:
    _now[0] = 1000.0
    monkeypatch.setattr(reservations, "time", types.SimpleNamespace(monotonic=lambda: _now[0]))


def _table() -> tuple[ReceiveTable, list[str]]:
    expired: list[str] = []
    return ReceiveTable(TTL_S, on_expire=expired.append), expired


def _past_ttl() -> None:
    _now[0] += TTL_S + 1


def test_an_engine_held_ticket_that_expires_is_reported_once_by_the_sweep() -> None:
    table, expired = _table()
    table.open("held", 0, 16, engine_held=True)
    table.open("engine-ttl", 0, 16)  # the engine's own TTL ends it: nothing to report
    table.close_expired()
    assert expired == []  # not yet
    _past_ttl()
    table.close_expired()
    table.close_expired()
    assert expired == ["held"]
    with pytest.raises(NotFoundError):
        table.hold("held", "any")


def test_a_lookup_that_finds_it_expired_reports_it_too() -> None:
    table, expired = _table()
    ticket = table.open("held", 0, 16, engine_held=True)
    _past_ttl()
    with pytest.raises(NotFoundError):
        table.hold("held", ticket.token)
    assert expired == ["held"]


def test_consumed_aborted_held_or_filling_tickets_are_not_reported() -> None:
    async def scenario() -> list[str]:
        table, expired = _table()
        table.open("consumed", 0, 16, engine_held=True)
        table.close("consumed")  # start_generate took it, or an abort ended it in the engine
        held = table.open("held", 0, 16, engine_held=True)
        table.hold("held", held.token)
        filling = table.open("filling", 0, 16, engine_held=True)
        table.claim_write("filling", filling.token, "agent")
        _past_ttl()
        table.close_expired()
        assert table.let_go("held", held) is True  # its TTL starts again from here
        table.close_expired()
        return expired

    assert asyncio.run(scenario()) == []


def test_a_finished_write_hands_the_ttl_back_to_the_engine() -> None:
    async def scenario() -> list[str]:
        table, expired = _table()
        ticket = table.open("written", 0, 16, engine_held=True)
        table.claim_write("written", ticket.token, "agent")
        table.finish(ticket)  # finish_kv_write restarted the engine's own TTL
        assert not ticket.engine_held
        _past_ttl()
        table.close_expired()
        return expired

    assert asyncio.run(scenario()) == []


def test_an_abandoned_claim_keeps_the_ticket_engine_held() -> None:
    async def scenario() -> list[str]:
        table, expired = _table()
        ticket = table.open("abandoned", 0, 16, engine_held=True)
        table.claim_write("abandoned", ticket.token, "agent")
        table.unclaim(ticket)  # the sender wrote nothing: the reservation stays, TTL anew
        assert ticket.engine_held
        _past_ttl()
        table.close_expired()
        return expired

    assert asyncio.run(scenario()) == ["abandoned"]


async def test_a_wait_for_the_kv_ends_with_the_fill_or_with_the_ticket() -> None:
    """wait_filled (a start marked after_kv_transfer): returns once a push or write finished
    into the ticket, at once if it has or if the window is empty; FailedPreconditionError when
    there is no ticket, or it closes or expires unfilled; a cancelled waiter leaves the others
    and the ticket as they were; an abandoned claim is not an end."""
    table, _ = _table()
    with pytest.raises(FailedPreconditionError, match="no open KV reservation"):
        await table.wait_filled("none")
    table.open("empty", 16, 16)
    await asyncio.wait_for(table.wait_filled("empty"), 5)  # nothing to wait for

    ticket = table.open("filled", 0, 16)
    first, second = (asyncio.ensure_future(table.wait_filled("filled")) for _ in range(2))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    claimed = table.claim_write("filled", ticket.token, "agent")
    table.abandon("filled", ticket.token, "agent")
    table.unclaim(claimed)
    await asyncio.sleep(0)
    assert not second.done()  # given up before writing: the KV may still come
    table.finish(table.claim("filled", ticket.token))
    await asyncio.wait_for(second, 5)
    await asyncio.wait_for(table.wait_filled("filled"), 5)  # filled before the wait

    table.open("aborted", 0, 16)
    waiting = asyncio.ensure_future(table.wait_filled("aborted"))
    await asyncio.sleep(0)
    table.close("aborted")
    with pytest.raises(FailedPreconditionError, match="ended before its KV arrived"):
        await asyncio.wait_for(waiting, 5)

    table.open("expired", 0, 16)
    waiting = asyncio.ensure_future(table.wait_filled("expired"))
    await asyncio.sleep(0)
    _past_ttl()
    table.close_expired()
    with pytest.raises(FailedPreconditionError, match="ended before its KV arrived"):
        await asyncio.wait_for(waiting, 5)
