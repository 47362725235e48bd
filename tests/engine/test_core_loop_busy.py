"""The engine's busy time: the core loop counts the time it worked (engine_busy_seconds), its
waits for a call with no work at all left out; waiting for calls while requests run is work."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

from engine_test_utils import random_prompt

from engine_shim.engine.api import SamplingParams, StatusFields, status_from_fields
from engine_shim.engine.core_loop import STOP, Call, CoreLoop
from engine_shim.engine.llm_engine import LLMEngine

_WAIT_S = 0.02  # every get of the inbox below takes at least this long


class _SlowInbox:
    """Answers each get after _WAIT_S: nothing while the loop does not block, STOP on the
    `stop_after`-th blocking get; times the blocking gets and the others apart."""

    def __init__(self, stop_after: int) -> None:
        self.stop_after = stop_after
        self.blocking_s: list[float] = []
        self.polling_s: list[float] = []

    def get(self, timeout: float | None) -> Call | str:
        started = time.perf_counter()
        time.sleep(_WAIT_S)
        if timeout is None:
            self.polling_s.append(time.perf_counter() - started)
            raise queue.Empty
        self.blocking_s.append(time.perf_counter() - started)
        if len(self.blocking_s) < self.stop_after:
            raise queue.Empty
        return STOP


def _run(engine: LLMEngine, inbox: _SlowInbox) -> tuple[float, list[StatusFields]]:
    """The loop's wall time, and the status fields it sent."""
    published: list[StatusFields] = []

    def emit(_batch: list[tuple[Any, ...]], fields: StatusFields) -> None:
        published.append(fields)

    started = time.perf_counter()
    CoreLoop(engine, inbox, emit).run()
    return time.perf_counter() - started, published


def test_waits_with_no_work_are_not_busy(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    inbox = _SlowInbox(stop_after=3)
    wall_s, _ = _run(engine, inbox)
    assert len(inbox.blocking_s) == 3 and not inbox.polling_s
    assert 0 <= engine.busy_time_s <= wall_s - sum(inbox.blocking_s)
    counters = status_from_fields(engine.status(), engine.status_fields()).counters
    assert counters is not None and counters.busy_time_s == engine.busy_time_s  # reported


def test_polls_while_requests_run_are_busy(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.start_generate("r", random_prompt(3, 20), 0, sampling)
    inbox = _SlowInbox(stop_after=1)  # the request ends, the loop blocks once: STOP
    wall_s, published = _run(engine, inbox)
    assert len(inbox.polling_s) >= 12  # one poll a step while the request ran
    assert len(inbox.blocking_s) == 1
    busy_s = engine.busy_time_s
    assert sum(inbox.polling_s) + engine.step_time_s <= busy_s <= wall_s - sum(inbox.blocking_s)
    sent = status_from_fields(engine.status(), published[-1]).counters
    assert sent is not None  # the last batch carried it all but the moments before the wait
    assert busy_s - sum(inbox.polling_s) / 2 < sent.busy_time_s <= busy_s
