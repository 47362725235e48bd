"""The capacity benchmark's reading of the shims' engine-step counters: a window's figures are
the difference of two scrapes of the shim's own /metrics page."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from bench.capacity.engine_steps import parse, window
from engine_shim.engine.api import EngineCounters
from engine_shim.metrics import _counters


class _Counters(Collector):
    def __init__(self) -> None:
        self.status: Any = SimpleNamespace(counters=EngineCounters(0, 0.0, 0, 0, 0))

    def collect(self) -> Iterator[Any]:
        yield from _counters(self.status)


def test_a_window_reports_its_own_steps_and_tokens() -> None:
    registry, source = CollectorRegistry(), _Counters()
    registry.register(source)
    source.status.counters = EngineCounters(100, 0.5, 3_000, 0, 0, 0.25)  # before the window
    opened = {"shim-both": parse(generate_latest(registry).decode())}
    source.status.counters = EngineCounters(600, 2.5, 67_000, 1, 0, 3.75)
    closed = {"shim-both": parse(generate_latest(registry).decode())}
    figures = window(opened, closed, window_s=4.0)["shim-both"]
    assert figures["steps"] == 500
    assert figures["tokens_per_step"] == pytest.approx(128.0)
    assert figures["step_ms"] == pytest.approx(4.0)
    assert figures["loop_ms_per_step"] == pytest.approx(8.0)
    assert figures["idle_ms_per_step"] == pytest.approx(1.0)  # 4 s less 3.5 busy, 500 steps
    assert figures["steps_per_s"] == pytest.approx(125.0)
    assert window(opened, opened, 4.0) == {"shim-both": {"steps": 0}}
