"""The engine's idle time: the core loop counts the time it waited for a call with no work at
all (engine_idle_seconds), and only that: waits for calls while requests run are not idle."""

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


def _run(engine: LLMEngine, inbox: _SlowInbox) -> list[StatusFields]:
    published: list[StatusFields] = []

    def emit(_batch: list[tuple[Any, ...]], fields: StatusFields) -> None:
        published.append(fields)

    CoreLoop(engine, inbox, emit).run()
    return published


def test_waits_with_no_work_are_idle(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    inbox = _SlowInbox(stop_after=3)
    _run(engine, inbox)
    assert len(inbox.blocking_s) == 3 and not inbox.polling_s
    assert engine.idle_time_s >= sum(inbox.blocking_s)
    assert engine.idle_time_s < sum(inbox.blocking_s) + 1.0
    counters = status_from_fields(engine.status(), engine.status_fields()).counters
    assert counters is not None and counters.idle_time_s == engine.idle_time_s  # reported


def test_polls_while_requests_run_are_not_idle(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.start_generate("r", random_prompt(3, 20), 0, sampling)
    inbox = _SlowInbox(stop_after=1)  # the request ends, the loop blocks once: STOP
    _run(engine, inbox)
    assert len(inbox.polling_s) >= 12  # one poll a step while the request ran
    assert len(inbox.blocking_s) == 1
    blocked, polled = sum(inbox.blocking_s), sum(inbox.polling_s)
    assert blocked <= engine.idle_time_s < blocked + polled / 2
