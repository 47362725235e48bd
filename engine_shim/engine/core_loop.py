"""The loop that drives an engine core, wherever it runs: in a thread of the shim's process or
in a process of its own (core_process.py). It takes calls from an inbox, steps the core while
it has work, and emits what happened in batches: every call's result and every step's events,
in order, each batch with the status the core had when it was sent (as api.StatusFields).

Calls are plain data (an op name and picklable arguments), so the same loop serves a thread
(queue.Queue) and a process (a pipe) without knowing which.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .api import EngineError, EngineStatus, KVChunk, KVLayout, StatusFields

if TYPE_CHECKING:
    import torch

    from .llm_engine import LLMEngine

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0  # longest idle sleep; calls wake the loop at once anyway
_SIDE_POLL_S = 0.0001  # while the side has work, the loop polls it at least this often (below)
# 0.1 ms, not 0.5: at one stream a send's copy (on the sender) and its notification (on the
# receiver) are each seen at the next poll, so the wait between polls is on the first token's
# path twice. A warm 256-token NIXL RemoteSend between two core processes on the 2-core VM
# (bench.kv_bench, tiny, alternating runs): 3.7 / 3.4 ms at 0.5 ms, 2.9 / 3.1 ms at 0.1 ms, the
# receiver's confirmation 0.8 -> 0.4 ms. A busy loop steps between polls and never waits here.
_EARLY_WAKE_S = 0.001  # an idle wait that ends this close to its end counts as ended
STOP = "stop"  # put in the inbox to end the loop

# Kinds of the entries of an emitted batch.
RESULT = 0  # (RESULT, call_id, value, error): a call's outcome
EVENTS = 1  # (EVENTS, events): one step's outputs and send notifications, in order
FAILED = 2  # (FAILED, error): a step failed; every request in flight is to be failed
SIDE = 3  # (SIDE, events): what the side (e.g. a KV transfer agent) reported, in order

# The core's methods a call may name (plus export_chunk below); nothing else is callable.
OPS = frozenset({
    "prep_recv", "import_kv", "abort", "begin_kv_write", "finish_kv_write", "cancel_kv_write",
    "remote_send",
    "send_slots", "finish_remote_send", "hold_reservation", "start_generate", "export_windows",
    "expire_reservation",
})


@dataclass(frozen=True, slots=True)
class Call:
    call_id: int | None  # None: nobody waits for the result
    op: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class CoreFacts:
    """What the host learns once the core has loaded and warmed up."""

    model_id: str
    kv_layout: KVLayout
    max_context_length: int
    vocab_size: int
    status: EngineStatus
    engine_tid: int  # the loop's thread id in the OS (/proc/TID/task/TID)
    kv_pool: torch.Tensor | None  # the KV pool, shared with the host (None: synthetic core)
    side: object = None  # what the loop's side reports of itself (Side.facts)


Emit = Callable[[list[tuple[Any, ...]], StatusFields], None]


class Inbox(Protocol):
    def get(self, timeout: float | None) -> Call | str:
        """The next call or STOP; waits up to `timeout` (None: do not wait) and raises
        queue.Empty when there is none."""
        ...


class Side(Protocol):
    """Work that must run in the core's thread beside the engine, outside its steps: a KV
    transfer agent that can only reach the pool from the process holding it (nixl_core.py).
    Its ops are called like the core's; `poll` runs every loop turn while it `is_busy`."""

    ops: frozenset[str]

    @property
    def is_busy(self) -> bool: ...

    def call(self, op: str, args: tuple[Any, ...]) -> object: ...

    def poll(self) -> list[Any]: ...

    def facts(self) -> object: ...

    def close(self) -> None: ...


# Builds a loop's side beside its core, in the core's process (picklable: a module-level
# function, or a functools.partial of one).
SideFactory = Callable[["LLMEngine"], Side]


def core_facts(core: LLMEngine) -> CoreFacts:
    kv_cache = getattr(core, "kv_cache", None)  # the benchmark-only synthetic core has none
    return CoreFacts(
        model_id=core.model_id,
        kv_layout=core.kv_layout,
        max_context_length=core.max_context_length,
        vocab_size=core.vocab_size,
        status=core.status(),
        engine_tid=threading.get_native_id(),
        kv_pool=None if kv_cache is None else kv_cache.kv,
    )


def run_op(core: LLMEngine, call: Call, side: Side | None = None) -> object:
    if side is not None and call.op in side.ops:
        return side.call(call.op, call.args)
    if call.op == "export_chunk":
        return export_chunk(core, *call.args)
    if call.op == "import_kv":
        request_id, chunk = call.args
        if callable(getattr(chunk, "data", None)):  # a window of a stage, by reference
            chunk = KVChunk(begin=chunk.begin, num_tokens=chunk.num_tokens, data=chunk.data())
        core.import_kv(request_id, chunk)
        return None
    if call.op not in OPS:
        raise EngineError(f"unknown engine op {call.op!r}")
    return getattr(core, call.op)(*call.args)


def export_chunk(
    core: LLMEngine,
    request_id: str,
    begin: int,
    num_tokens: int,
    is_last: bool,
    out: torch.Tensor | None,
    export_into: Callable[[int, int], torch.Tensor] | None = None,
) -> KVChunk:
    """One chunk of a send's KV; the send's pages are released after the last one.
    `export_into` (a core in its own process): the chunk goes into the tensor it names, and
    only its place comes back (data None), not its bytes."""
    if export_into is not None:
        out = export_into(begin, num_tokens)
    chunk = core.export_kv(request_id, begin, num_tokens, out)
    if is_last:
        core.finish_remote_send(request_id)
    if export_into is not None:
        return KVChunk(begin=chunk.begin, num_tokens=chunk.num_tokens, data=None)
    return chunk


class CoreLoop:
    def __init__(self, core: LLMEngine, inbox: Inbox, emit: Emit, side: Side | None = None) -> None:
        self._core = core
        self._inbox = inbox
        self._emit = emit
        self._side = side
        self._out: list[tuple[Any, ...]] = []
        self._busy_since: float | None = time.perf_counter()  # None while waiting idle

    def run(self) -> None:
        """Until STOP: run the calls that came in (waiting for one while idle), then a step."""
        core = self._core
        while self._run_calls(block=not core.has_work):
            if core.has_work:
                self._step()

    def _run_calls(self, block: bool) -> bool:
        core = self._core
        timeout = self._idle_timeout() if block else None
        idle_ends = None if timeout is None else time.monotonic() + timeout
        if timeout is not None and self._side is not None and self._side.is_busy:
            timeout = min(timeout, _SIDE_POLL_S)  # wake to poll the side meanwhile
        if block:  # no work until a call comes: the loop is idle while it waits
            self._count_busy(keep_counting=False)
        try:
            while True:
                try:
                    item = self._inbox.get(timeout)
                except queue.Empty:
                    self._busy_since = self._busy_since or time.perf_counter()
                    if idle_ends is not None and time.monotonic() >= idle_ends - _EARLY_WAKE_S:
                        core.reap_expired_reservations()  # and fences past their end
                        self._out.append((EVENTS, []))  # what they freed shows in GetStatus
                    return True
                self._busy_since = self._busy_since or time.perf_counter()
                if item == STOP:
                    return False
                assert isinstance(item, Call)
                self._execute(item)
                timeout = None  # after the first call, drain without waiting
        finally:
            self._flush()

    def _count_busy(self, keep_counting: bool) -> None:
        """The time since the loop last counted into the core's busy time (its counters
        report it: engine_busy_seconds); counted at every flush, so the status it sends is
        never behind by more than a turn, and before each idle wait, which is left out. (An
        idle counter would only learn a wait's length as it ends: a scrape during a long wait
        would not see it.)"""
        if self._busy_since is not None:
            now = time.perf_counter()
            self._core.busy_time_s += now - self._busy_since
            self._busy_since = now if keep_counting else None

    def _idle_timeout(self) -> float:
        deadline = self._core.next_deadline()
        if deadline is None:
            return _IDLE_WAIT_S
        return min(_IDLE_WAIT_S, max(0.0, deadline - time.monotonic()) + 0.01)

    def _execute(self, call: Call) -> None:
        value: object = None
        error: BaseException | None = None
        try:
            value = run_op(self._core, call, self._side)
        except EngineError as exc:
            error = exc
        except Exception as exc:
            logger.exception("engine call %s failed", call.op)
            error = EngineError(f"internal engine error: {exc}")
        if call.call_id is not None:
            self._out.append((RESULT, call.call_id, value, error))
            return
        if error is not None:  # nobody will see it otherwise
            logger.warning("engine call %s, not waited for, failed: %s", call.op, error)
        if self._side is None or call.op not in self._side.ops:
            # Nobody waits for it (an abort, a send's release), but what it changed must show
            # in GetStatus: an empty batch carries the status out now, not with the next one.
            self._out.append((EVENTS, []))

    def _step(self) -> None:
        try:
            events = self._core.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests in flight")
            self._out.append((FAILED, EngineError(f"internal engine error: {exc}")))
        else:
            if events:
                # One hand-off per step, whatever the batch size: a wake-up of the event
                # loop per output was the shim's largest per-token cost.
                self._out.append((EVENTS, events))
        self._flush()

    def _flush(self) -> None:
        side = self._side
        if side is not None and side.is_busy:
            try:
                events = side.poll()
            except Exception as exc:  # noqa: BLE001 - the side's own failure, not the engine's
                logger.exception("polling the core's side failed")
                events = [("failed", f"{type(exc).__name__}: {exc}")]
            if events:
                self._out.append((SIDE, events))
        if self._out:
            self._count_busy(keep_counting=True)
            out, self._out = self._out, []
            self._emit(out, self._core.status_fields())  # the status travels with what changed it
