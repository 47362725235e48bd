"""NIXL with the engine core in a process of its own: the agent lives in the core's process,
beside the pool it registers, and the shim drives it through the core's pipe.

UCX cannot write a pool that the writing process holds only as a CUDA IPC mapping (every
write failed NIXL_ERR_NOT_FOUND at initialize_xfer on an H200, nixl-cu13 1.5.1), so a core
in its own process keeps the agent: `NixlSide` is the core loop's side (core_loop.Side),
called between engine steps and polled each loop turn while a write or a notification is
pending; `CoreNixlPlane` is the same interface as the shim's own NixlPlane, each call an op
to the core, each completion an event back. The rules of the handshake around a write
(nixl_sender.py, nixl_receiver.py) do not change: only where the agent runs does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from engine_shim.backends.embedded.kv_plane.addr import NixlOffer
from engine_shim.backends.embedded.kv_plane.nixl import (
    HeldSlots,
    NixlAgent,
    NotificationWaits,
    WriteNotStarted,
    offer_region,
    start_agent,
)
from engine_shim.engine.api import EngineError, UnavailableError

if TYPE_CHECKING:
    from engine_shim.engine.async_engine import AsyncEngine
    from engine_shim.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# The writes posted in one loop turn are checked together in a tight loop before the loop's
# next turn (0.1 ms away when idle, a whole step away when busy) for this long plus their
# bytes at _SPIN_BYTES_PER_S: a copy on one host usually ends within it, and the receiver's
# notification goes out only from a check of this side's agent once the copy has ended. One
# window a turn, not one a write: a prefill step that computes 32 sends' KV posts 32 writes in
# one turn, and a window each (run 23, H100: the copies waited on the decoding engine's work on
# the same GPU, so every window ran out) held the last write back by 32 windows.
_WRITE_SPIN_S = 0.0002
_SPIN_BYTES_PER_S = 200e9

# The state a write ends in when it was dropped before anything was posted: nothing of it
# can land, so the sender may abandon its claim (AbandonKVWrite) instead of leaving the
# receiver to fence the pages.
NOT_STARTED = "NOTSTARTED"

# A notification that comes before its write is expected here is kept this long for the
# expect that the receiving shim has already sent (the longest write deadline a receiver
# grants, nixl_receiver.MAX_WRITE_DEADLINE_MS), then dropped.
_EARLY_KEEP_S = 120.0

# A posted write still running, or an expected write whose notification has not come, this
# long after it began is logged (once) at WARNING: a write on one host takes milliseconds, so
# one this slow is stuck, and its send fails at its deadline (the log says which side waited).
_SLOW_S = 1.0

# A write whose send is still computing waits in the core (parked) until this long before
# its deadline (half its time where that is shorter), then ends NOT_STARTED: its sender can
# then abandon the claim (and hold the reservation, then claim again once the KV is there)
# before the receiver's own deadline fences the pages.
PARK_MARGIN_S = 2.0

# A write given up (its send ended, or its deadline passed) is withdrawn from the core, which
# says whether it was only parked; a core that does not answer within this long (stuck in a
# step, or gone) counts as one that had posted it: the write fails, its pages fenced.
_WITHDRAW_S = 2.0

_EXPECT, _FORGET = "nixl_expect", "nixl_forget"
_LOAD, _DROP = "nixl_load_peer", "nixl_drop_peer"
_WRITE, _CANCEL = "nixl_write", "nixl_cancel"
_LANDED = "nixl_landed"


# ---- in the core's process ----

@dataclass(eq=False)
class _Posted:
    """A write this side posted: its transfer handle and what a slow one's log names."""

    handle: Any
    agent: str
    num_bytes: int
    started: float
    is_reported: bool = False  # logged as slow


class _Parked(NamedTuple):
    """A write of a send still computing, waiting in the core to be posted."""

    offer: NixlOffer
    send: HeldSlots
    remote: np.ndarray
    tag: bytes
    park_until: float
    since: float


@dataclass(eq=False)
class _Expected:
    """A write the receiving shim claimed for `sender`, until its notification comes."""

    sender: str
    request_id: str
    since: float
    is_reported: bool = False


class NixlSide:
    """The agent in the core's loop. Events back: ("notif", sender, tag, error) for every
    notification while writes are expected, the write of an expected one completed in the
    engine first (finish_kv_write: error "" or what it raised), so the receiving shim need not
    ask the engine again; ("write", xfer_id, state, error) when a write of this side ends.

    A write of a held send that is still computing is parked and posted in the first loop
    turn that finds the send's KV written (the shim claims the receiver's slots while the
    engine computes, so the write starts without another message from it); it ends
    NOT_STARTED if the send ends first or it is still parked at `park_until` (the write's
    deadline less PARK_MARGIN_S)."""

    ops = frozenset({_EXPECT, _FORGET, _LOAD, _DROP, _WRITE, _CANCEL, _LANDED})

    def __init__(self, core: LLMEngine, agent: NixlAgent | None, reason: str = "") -> None:
        self._core = core  # reads held sends' slots, completes expected writes
        self._agent = agent
        self._reason = reason
        self._expected: dict[bytes, _Expected] = {}  # by tag
        # tag -> [(sender agent, when read)]: notifications read before their expect was. The
        # receiving shim sends `ready` right after its expect (and the engine's
        # begin_kv_write before it) without waiting for this loop to run them, and the loop
        # may read the agent's notifications after a step before it reads those calls.
        self._early: dict[bytes, list[tuple[str, float]]] = {}
        self._writes: dict[int, _Posted] = {}  # by xfer id
        self._parked: dict[int, _Parked] = {}  # by xfer id: waiting for the send
        self._ended: list[Any] = []  # writes that failed to start, reported at the next poll
        self._fresh: list[_Posted] = []  # posted since the last poll: checked together there

    @property
    def is_busy(self) -> bool:
        return bool(self._writes or self._ended or self._expected or self._parked or self._early
                    or self._agent is not None and self._agent.is_notifying)

    def facts(self) -> tuple[NixlOffer | None, str]:
        return (None, self._reason) if self._agent is None else (self._agent.offer(), "")

    def call(self, op: str, args: tuple[Any, ...]) -> object:
        agent = self._agent
        if agent is None:
            raise UnavailableError(f"no NIXL agent in the engine core: {self._reason}")
        if op == _EXPECT:
            tag, sender, request_id = args
            self._expected[tag] = _Expected(sender, request_id, time.monotonic())
        elif op == _FORGET:
            expected = self._expected.pop(args[0], None)
            if expected is not None and expected.is_reported:
                logger.warning("gave up the KV write of %s from agent %s after %.1f s with no "
                               "notification", expected.request_id, expected.sender,
                               time.monotonic() - expected.since)
            self._early.pop(args[0], None)
        elif op == _LOAD:
            return agent.load_peer(args[0])
        elif op == _DROP:
            agent.drop_peer(args[0])
        elif op == _WRITE:
            self._start_write(*args)
        elif op == _LANDED:  # the receiver confirmed: a notification sent on its own has left
            agent.confirmed(args[0])
        elif op == _CANCEL:
            # True: it was still parked, so nothing of it was posted
            parked = self._parked.pop(args[0], None)
            if parked is not None:
                waited = time.monotonic() - parked.since
                if waited > _SLOW_S:
                    logger.warning("withdrew a KV write of send %s parked for %.1f s (%s)",
                                   parked.send.request_id, waited,
                                   self._core.describe_send(parked.send.request_id))
                return True
            posted = self._writes.pop(args[0], None)
            if posted is not None:
                if posted in self._fresh:  # released below: never checked again
                    self._fresh.remove(posted)
                try:
                    state = agent.state(posted.handle)
                except Exception:  # noqa: BLE001 - NIXL's own error types; released below anyway
                    state = "ERR"
                if state == "PROC" and time.monotonic() - posted.started > _SLOW_S:
                    logger.warning("cancelling a KV write of %d bytes to agent %s still running "
                                   "after %.1f s", posted.num_bytes, posted.agent,
                                   time.monotonic() - posted.started)
                agent.release(posted.handle)
            return False
        return None

    def _start_write(self, xfer_id: int, offer: NixlOffer, local: np.ndarray | HeldSlots,
                     remote: np.ndarray, tag: bytes, park_until: float = math.inf) -> None:
        if isinstance(local, HeldSlots):
            is_ready = self._core.send_is_ready(local.request_id)
            if is_ready is None:
                self._ended.append(("write", xfer_id, NOT_STARTED, "the send has ended"))
                return
            if not is_ready:
                self._parked[xfer_id] = _Parked(offer, local, remote, tag, park_until, time.monotonic())
                return
        self._post(xfer_id, offer, local, remote, tag)

    def _post_parked(self) -> None:
        now = time.monotonic()
        for xfer_id, (offer, local, remote, tag, park_until, _) in list(self._parked.items()):
            is_ready = self._core.send_is_ready(local.request_id)
            if is_ready is None or now > park_until:
                del self._parked[xfer_id]
                why = "the send has ended" if is_ready is None else "its deadline nears"
                if is_ready is not None:  # the sender claims again once the KV is there
                    logger.info("gave up a KV write of send %s as its deadline nears: its KV "
                                "was not ready (%s)", local.request_id,
                                self._core.describe_send(local.request_id))
                self._ended.append(("write", xfer_id, NOT_STARTED, why))
            elif is_ready:
                del self._parked[xfer_id]
                self._post(xfer_id, offer, local, remote, tag)

    def _post(self, xfer_id: int, offer: NixlOffer, local: np.ndarray | HeldSlots,
              remote: np.ndarray, tag: bytes) -> None:
        agent = self._agent
        assert agent is not None
        try:
            if isinstance(local, HeldSlots):
                local = self._held_slots(local)
            handle, state, num_bytes = agent.start_write(offer, local, remote, tag)
        except EngineError as error:  # UnavailableError included
            self._ended.append(("write", xfer_id, "ERR", str(error)))
            return
        posted = _Posted(handle, offer.agent, num_bytes, time.monotonic())
        self._writes[xfer_id] = posted  # poll() reports it, ended or not
        if state == "PROC":
            self._fresh.append(posted)

    def _spin_fresh(self) -> None:
        """Check the writes posted since the last poll in a tight loop until they have all
        ended or one window (_WRITE_SPIN_S plus their bytes at _SPIN_BYTES_PER_S) has passed;
        each check progresses the agent, which sends a finished copy's notification."""
        agent = self._agent
        fresh, self._fresh = self._fresh, []
        if agent is None or not fresh:
            return
        spin_ends = time.perf_counter() + _WRITE_SPIN_S + \
            sum(posted.num_bytes for posted in fresh) / _SPIN_BYTES_PER_S
        while fresh and time.perf_counter() < spin_ends:
            fresh = [posted for posted in fresh if _is_running(agent, posted)]

    def _held_slots(self, ref: HeldSlots) -> np.ndarray:
        # send_slots waits for the engine's pending KV writes (CUDA) before the read
        slots = self._core.send_slots(ref.request_id)
        return np.asarray(slots[ref.offset :], dtype=np.int64)

    def poll(self) -> list[Any]:
        agent = self._agent
        assert agent is not None  # busy only once a call reached the agent
        if self._parked:
            self._post_parked()
        self._spin_fresh()
        if agent.is_notifying:
            agent.progress()
        events, self._ended = self._ended, []
        if self._early:
            events += self._match_early()
        if self._expected:
            try:
                notifications = agent.notifications()
            except Exception as error:  # noqa: BLE001 - NIXL raises its own error types
                # As the in-shim listener does: stop reading; the waiting writes end at their
                # deadlines (UNAVAILABLE), their pages fenced.
                logger.exception("reading NIXL notifications failed")
                self._expected.clear()
                notifications = []
                events.append(("failed", f"reading notifications: {error}"))
            for sender, tag in notifications:
                if tag in self._expected:
                    events.append(self._landed(sender, tag))
                else:  # its expect is still on its way (or it is not ours): kept, not passed on
                    self._early.setdefault(tag, []).append((sender, time.monotonic()))
        now = time.monotonic()
        for xfer_id, posted in list(self._writes.items()):
            try:
                state, error_text = agent.state(posted.handle), ""
            except Exception as error:  # noqa: BLE001 - likewise
                state, error_text = "ERR", str(error)
            if state != "PROC":
                del self._writes[xfer_id]
                agent.release(posted.handle)
                events.append(("write", xfer_id, state, error_text))
            elif not posted.is_reported and now - posted.started > _SLOW_S:
                posted.is_reported = True
                logger.warning("a KV write of %d bytes to agent %s is still running after %.1f s",
                               posted.num_bytes, posted.agent, now - posted.started)
        for expected in self._expected.values():
            if not expected.is_reported and now - expected.since > _SLOW_S:
                expected.is_reported = True
                logger.warning("no notification of the KV write of %s from agent %s after %.1f s "
                               "(%d notifications kept for writes not yet expected)",
                               expected.request_id, expected.sender, now - expected.since,
                               len(self._early))
        return events

    def _match_early(self) -> list[Any]:
        """Notifications kept until their expect came: landed now that it has (the engine's
        begin_kv_write, sent before it, has run too); those kept too long are passed on as
        unexpected (the shim logs and ignores them)."""
        events: list[Any] = []
        now = time.monotonic()
        for tag, kept in list(self._early.items()):
            if tag in self._expected:
                del self._early[tag]
                for sender, _ in kept:  # in the order read; the claimed agent's lands
                    events.append(self._landed(sender, tag))
            elif now - kept[0][1] > _EARLY_KEEP_S:
                del self._early[tag]
                events += [("notif", sender, tag, "no write of this agent was expected")
                           for sender, _ in kept]
        return events

    def _landed(self, sender: str, tag: bytes) -> tuple[str, str, bytes, str]:
        """A notification: an expected write from its claimed sender has landed, and is
        completed in the engine here, in the loop's turn that saw it. Any other is passed on
        untouched (the shim logs and ignores it)."""
        expected = self._expected.get(tag)
        if expected is None or expected.sender != sender:
            return ("notif", sender, tag, "not the claimed agent's write")
        del self._expected[tag]
        if expected.is_reported:
            logger.warning("the notification of the KV write of %s came after %.1f s",
                           expected.request_id, time.monotonic() - expected.since)
        try:
            self._core.finish_kv_write(expected.request_id)
        except EngineError as error:  # e.g. aborted meanwhile: the shim ends the write
            return ("notif", sender, tag, str(error) or type(error).__name__)
        return ("notif", sender, tag, "")

    def close(self) -> None:
        self._fresh.clear()
        if self._agent is not None:
            for posted in self._writes.values():
                self._agent.release(posted.handle)
            self._writes.clear()
            self._agent.close()


def _is_running(agent: NixlAgent, posted: _Posted) -> bool:
    """Whether a posted write still runs; one that fails to answer counts as ended (poll()
    asks again and reports it)."""
    try:
        return agent.state(posted.handle) == "PROC"
    except Exception:  # noqa: BLE001 - NIXL raises its own error types
        return False


def nixl_side(core: LLMEngine, loopback: bool, local_copy: bool = True) -> NixlSide:
    """The core's side with an agent over its pool, or without one and the reason (NIXL
    missing or failing to start). `loopback`: the shim is bound to loopback, and so is UCX;
    `local_copy`: start_agent's."""
    agent, reason = start_agent(core.kv_cache.kv, loopback, local_copy)
    return NixlSide(core, agent, reason)


# ---- in the shim ----

class CoreNixlPlane:
    """NixlPlane's interface over the agent in the core's process."""

    def __init__(self, engine: AsyncEngine, offer: NixlOffer) -> None:
        self._engine = engine
        self._offer = offer
        self.name = offer.agent
        self.region = offer_region(offer)
        self.mem_type = offer.mem_type
        self.reads_held_slots = True
        self.finishes_writes = True
        self._waits = NotificationWaits()
        self._writes: dict[int, asyncio.Future[tuple[str, str]]] = {}
        self._xfer_ids = itertools.count()
        self._peers: dict[str, str] = {}  # agent name -> metadata the core has loaded
        engine.on_side_events = self._on_events

    def offer(self) -> NixlOffer:
        return self._offer

    # ---- receiving side ----
    def expect(self, sender_agent: str, tag: bytes, request_id: str) -> asyncio.Future[None]:
        future = self._waits.add(sender_agent, tag)
        # in order before the begin_kv_write that precedes the sender's go-ahead
        self._engine.submit_side(_EXPECT, tag, sender_agent, request_id)
        return future

    def forget(self, tag: bytes) -> None:
        if self._waits.forget(tag):
            self._engine.submit_side(_FORGET, tag)

    # ---- sending side ----
    async def load_peer(self, offer: NixlOffer) -> str:
        if self._peers.get(offer.agent) != offer.metadata:
            name = await self._engine.call_side(_LOAD, offer)
            self._peers[name] = offer.metadata
        return offer.agent

    def drop_peer(self, agent: str) -> None:
        if self._peers.pop(agent, None) is not None:
            self._engine.submit_side(_DROP, agent)

    async def write(
        self,
        offer: NixlOffer,
        local_slots: np.ndarray | HeldSlots,
        remote_slots: np.ndarray,
        tag: bytes,
        *,
        deadline: float,
        peer: asyncio.Future[Any],
        peer_landed: Callable[[], bool],
        stop: asyncio.Future[None] | None = None,
    ) -> int:
        """KVWritePlane.write. The receiver's confirmation usually comes first under load:
        the core reports its side's end only between steps. The core then releases the
        transfer itself once it ends; only a failed write is cancelled from here. A write of
        a send still computing waits in the core (parked) until its KV is written."""
        xfer_id = next(self._xfer_ids)
        ended: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()
        self._writes[xfer_id] = ended
        is_over = False  # ended here, or landed at the peer
        waits: set[asyncio.Future[Any]] = {ended, peer} if stop is None else {ended, peer, stop}
        park_until = deadline - min(PARK_MARGIN_S, (deadline - time.monotonic()) / 2)
        try:
            self._engine.submit_side(_WRITE, xfer_id, offer, local_slots, remote_slots, tag,
                                     park_until)
            while not ended.done():
                if peer.done():
                    if not peer_landed():
                        raise UnavailableError(f"KV write to agent {offer.agent} did not complete")
                    is_over = True
                    return self.region.bytes_of(len(remote_slots))
                if stop is not None and stop.done():
                    is_over = True
                    await self._withdraw(xfer_id, ended)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    is_over = True
                    await self._withdraw_late(xfer_id, ended, offer.agent)
                await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            is_over = True
            state, error = ended.result()
            if state == NOT_STARTED:
                raise WriteNotStarted(f"KV write to agent {offer.agent} not started: {error}")
            if state != "DONE" and not peer_landed():
                raise UnavailableError(f"KV write to agent {offer.agent} failed ({error or state})")
        finally:
            if not is_over:
                self._engine.submit_side(_CANCEL, xfer_id)  # releases (cancels) the transfer
            self._writes.pop(xfer_id, None)
        return self.region.bytes_of(len(remote_slots))  # the side checked they pair up

    def landed(self, offer: NixlOffer, tag: bytes) -> None:
        """KVWritePlane.landed: where the write may have been copies into the receiver's
        mapped pool, their notification (sent on its own) has left, and the core's agent
        need no longer progress for it."""
        if offer.mapping is not None:
            self._engine.submit_side(_LANDED, tag)

    async def _withdraw_late(self, xfer_id: int, ended: asyncio.Future[tuple[str, str]],
                             agent: str) -> None:
        """A write whose deadline passed: withdrawn. WriteNotStarted when it was still parked
        (the send's KV not computed by then: the caller may claim again and write once it
        is; the core gives such a write up at `park_until`, but only between steps, so a
        step longer than the margin can leave one parked here), else UnavailableError."""
        try:
            await self._withdraw(xfer_id, ended)
        except WriteNotStarted:
            raise WriteNotStarted(f"KV write to agent {agent} not started by its deadline: its "
                                  "KV was not computed by then") from None
        except UnavailableError:
            logger.warning("KV write %d to agent %s: neither its end nor the receiver's "
                           "confirmation came by its deadline", xfer_id, agent)
            raise UnavailableError(f"KV write to agent {agent} did not complete") from None

    async def _withdraw(self, xfer_id: int, ended: asyncio.Future[tuple[str, str]]) -> None:
        """Give a write up; raises WriteNotStarted when nothing of it was posted (it was still
        parked, or the core had dropped it so: that event comes before the call's answer),
        else UnavailableError (the core has cancelled it, or did not answer in _WITHDRAW_S)."""
        try:
            async with asyncio.timeout(_WITHDRAW_S):
                was_parked = await self._engine.call_side(_CANCEL, xfer_id)
        except (EngineError, TimeoutError):
            was_parked = False
        if was_parked or ended.done() and ended.result()[0] == NOT_STARTED:
            raise WriteNotStarted("KV write withdrawn before it started")
        raise UnavailableError("KV write withdrawn")

    def _on_events(self, events: list[Any]) -> None:
        for event in events:
            kind = event[0]
            if kind == "notif":
                _, sender, tag, error = event
                self._waits.deliver(sender, tag, UnavailableError(
                    f"completing the KV write in the engine failed: {error}") if error else None)
            elif kind == "write":
                future = self._writes.get(event[1])
                if future is not None and not future.done():
                    future.set_result((event[2], event[3]))
            elif kind == "failed":
                logger.error("the engine core's NIXL agent failed: %s", event[1])

    def close(self) -> None:
        self._waits.close()
        for future in self._writes.values():
            future.cancel()
