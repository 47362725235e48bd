"""The reservations PrepRecv opened on the receiving side, by request id: each guarded by a
random token, optionally with a shared-memory stage, alive while a push fills it or a NIXL
sender holds it (hold.py), gone once its TTL passes otherwise.

Where the engine's reservation has no TTL of its own (`engine_held`: made so where a NIXL
write may come, prep_recv(held=True)), this table's TTL is the only one: a ticket that
expires is reported (`on_expire`) so the engine frees its pages, and until then a NIXL claim
may begin its write without asking the engine first (nixl_receiver.py)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine_shim.backends.embedded.kv_plane.shm import StagingPool, StagingSegment
from engine_shim.engine.api import AlreadyExistsError, FailedPreconditionError, NotFoundError


@dataclass
class Ticket:
    token: str
    begin: int  # first position to receive (the receiver's prefix_matched_length)
    end: int
    expires_at_s: float
    staging: StagingSegment | None = None  # the shared-memory stage offered with it, if any
    is_receiving: bool = False
    write_digest: str | None = None  # of the NIXL write offer made with it, if any
    num_holds: int = 0  # open HoldKV calls (hold.py)
    # of those, the ones whose hold the engine has confirmed: while any is, the engine's
    # reservation cannot expire, so a write may begin without waiting for the engine
    num_engine_holds: int = 0
    # the engine's reservation has no TTL: this ticket's expiry ends it (on_expire), and
    # until a write into it has finished the engine cannot free it by itself
    engine_held: bool = False
    # a NIXL claim (WriteKV): its sender's agent, and set when that sender abandons it
    writer: str | None = None
    abandoned: asyncio.Future[None] | None = None
    # every position of [begin, end) has arrived (a push or write finished into it)
    is_filled: bool = False
    # made by wait_filled: True once filled, False once the ticket closed without its KV
    filled: asyncio.Future[bool] | None = None

    @property
    def is_held(self) -> bool:
        """Being filled or held for a sender that is still computing: it does not expire."""
        return self.is_receiving or self.num_holds > 0

    def is_expired(self, now: float) -> bool:
        return not self.is_held and self.expires_at_s <= now


class ReceiveTable:
    """Open reservations by request id; expired ones are invisible (the engine's TTL frees
    their pages). Each may hold a leased shared-memory stage, given back to `staging` when
    the ticket closes: for reuse after a completed push, retired otherwise."""

    def __init__(self, ttl_s: float, staging: StagingPool | None = None,
                 on_expire: Callable[[str], None] | None = None) -> None:
        self._ttl_s = ttl_s
        self._staging = staging
        self._tickets: dict[str, Ticket] = {}
        # told (at once, in the same turn) of every engine-held ticket that expires
        self.on_expire = on_expire

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    def __len__(self) -> int:
        return len(self._tickets)

    def get(self, request_id: str) -> Ticket | None:
        """The request's ticket, expired or not."""
        return self._tickets.get(request_id)

    def open(self, request_id: str, begin: int, end: int, num_kv_bytes: int = 0,
             stage_backed: bool = True, engine_held: bool = False) -> Ticket:
        """A new ticket; with a stage for `num_kv_bytes` when shared memory is on and the
        pool has room (`stage_backed` False: its pages are not allocated up front, for a
        reservation that also offers a NIXL write). `engine_held`: the engine's reservation
        has no TTL; this ticket's ends it."""
        self.close_expired()
        self.close(request_id)
        staging = None
        if self._staging is not None and num_kv_bytes > 0:
            staging = self._staging.lease(num_kv_bytes, stage_backed)
        ticket = Ticket(secrets.token_hex(16), begin, end, time.monotonic() + self._ttl_s, staging,
                        engine_held=engine_held)
        self._tickets[request_id] = ticket
        return ticket

    def claim(self, request_id: str, token: str) -> Ticket:
        ticket = self._live(request_id, token)
        if ticket.is_receiving:
            raise AlreadyExistsError(f"a KV push for {request_id!r} is already in progress")
        ticket.is_receiving = True  # a ticket being filled does not expire
        return ticket

    def claim_write(self, request_id: str, token: str, sender_agent: str) -> Ticket:
        """claim() for a NIXL write by `sender_agent`, which may abandon it (abandon())."""
        ticket = self.claim(request_id, token)
        ticket.writer = sender_agent
        ticket.abandoned = asyncio.get_running_loop().create_future()
        return ticket

    def abandon(self, request_id: str, token: str, sender_agent: str) -> None:
        """The claimed writer gives its claim up before writing (AbandonKVWrite)."""
        ticket = self._live(request_id, token)
        abandoned = ticket.abandoned
        if ticket.writer != sender_agent or abandoned is None or abandoned.done():
            raise NotFoundError(f"no open KV write claim on {request_id!r} by that agent")
        abandoned.set_result(None)

    def unclaim(self, ticket: Ticket) -> None:
        """A claim ended with nothing written: the ticket is open again, its TTL restarted."""
        ticket.is_receiving = False
        ticket.writer = ticket.abandoned = None
        ticket.expires_at_s = time.monotonic() + self._ttl_s

    def hold(self, request_id: str, token: str) -> Ticket:
        """One more holder of the ticket: it does not expire until every holder let go."""
        ticket = self._live(request_id, token)
        ticket.num_holds += 1
        return ticket

    def let_go(self, request_id: str, ticket: Ticket) -> bool:
        """One holder fewer; True when the ticket is still open and now unheld (its TTL
        starts again, now)."""
        ticket.num_holds -= 1
        if self._tickets.get(request_id) is not ticket or ticket.is_held:
            return False
        ticket.expires_at_s = time.monotonic() + self._ttl_s
        return True

    def _live(self, request_id: str, token: str) -> Ticket:
        ticket = self._tickets.get(request_id)
        if ticket is not None and ticket.is_expired(time.monotonic()):
            self._expire(request_id, ticket)
            ticket = None
        if ticket is None or not secrets.compare_digest(ticket.token, token):
            raise NotFoundError(f"no open KV reservation for {request_id!r} with that token")
        return ticket

    async def wait_filled(self, request_id: str) -> None:
        """Returns once the reservation's KV has arrived (at once if it has, or if it
        awaits none); FailedPreconditionError when there is no reservation, or it ends
        without its KV. Cancelling the wait leaves the ticket as it was."""
        ticket = self._tickets.get(request_id)
        if ticket is None:
            raise FailedPreconditionError(f"no open KV reservation for {request_id!r} to wait for")
        if ticket.is_filled or ticket.begin >= ticket.end:
            return
        if ticket.filled is None:
            ticket.filled = asyncio.get_running_loop().create_future()
        if not await asyncio.shield(ticket.filled):
            raise FailedPreconditionError(
                f"the KV reservation for {request_id!r} ended before its KV arrived")

    def finish(self, ticket: Ticket) -> None:
        """A push into `ticket` completed: its stage can serve another reservation, and its
        TTL starts again."""
        ticket.is_filled = True
        if ticket.filled is not None and not ticket.filled.done():
            ticket.filled.set_result(True)
        self.unclaim(ticket)
        # the engine ended its hold with the write (finish_kv_write restarts its TTL): a
        # later claim waits for the engine again, even under a HoldKV still open
        ticket.num_engine_holds = 0
        ticket.engine_held = False
        self._give_back(ticket, is_clean=True)

    def retire(self, request_id: str, ticket: Ticket) -> None:
        """The start that waited for `ticket`'s KV has run to its end: the ticket has served.
        Closed now or, while a push or write is still finishing into it (a short request can
        end before the receiving side's own last steps), as that finishes; left open, it
        would stay in the table until its TTL, and every open scans the table."""
        if not self.is_open(request_id, ticket):
            return
        if not ticket.is_receiving:
            self.close(request_id)
            return
        if ticket.filled is None:
            ticket.filled = asyncio.get_running_loop().create_future()
        ticket.filled.add_done_callback(lambda _: self._close_if_open(request_id, ticket))

    def _close_if_open(self, request_id: str, ticket: Ticket) -> None:
        if self.is_open(request_id, ticket):
            self.close(request_id)

    def is_open(self, request_id: str, ticket: Ticket) -> bool:
        """Whether `ticket` is still the request's open one."""
        return self._tickets.get(request_id) is ticket

    def close(self, request_id: str) -> Ticket | None:
        """End the ticket (its stage given back); the ticket it was, if any."""
        ticket = self._tickets.pop(request_id, None)
        if ticket is not None:
            self._give_back(ticket, is_clean=False)
            if ticket.filled is not None and not ticket.filled.done():
                ticket.filled.set_result(False)
        return ticket

    def close_all(self) -> None:
        for request_id in list(self._tickets):
            self.close(request_id)

    def close_expired(self) -> None:
        """Close every expired ticket (those the engine holds reported to on_expire). Made at
        every open and by the owner's sweep, so an engine-held reservation ends within a
        sweep's interval of its TTL."""
        now = time.monotonic()
        expired = [(r, t) for r, t in self._tickets.items() if t.is_expired(now)]
        for request_id, ticket in expired:
            self._expire(request_id, ticket)

    def _expire(self, request_id: str, ticket: Ticket) -> None:
        self.close(request_id)
        if ticket.engine_held and self.on_expire is not None:
            self.on_expire(request_id)

    def _give_back(self, ticket: Ticket, is_clean: bool) -> None:
        staging, ticket.staging = ticket.staging, None
        if staging is not None and self._staging is not None:
            self._staging.give_back(staging, is_clean)
