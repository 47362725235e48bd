"""BENCHMARK ONLY. When a synthetic step would end on the GPU it stands for.

A decode-only step that continues the previous one is chained: the real engine launches it
before collecting its predecessor, so it starts when the previous step ends (or, if the host
came back later than that, when the previous step() was entered). Any other step needs the
host to schedule it, so it starts when step() is called or when the previous step ends,
whichever is later. Host work done inside a step overlaps the "device" either way."""

from __future__ import annotations


class DeviceClock:
    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None  # (step() entered, step ended)

    def step_ends_at(self, called_at: float, duration_s: float, is_chained: bool) -> float:
        if self._last is None:
            start = called_at
        else:
            last_called_at, last_ends_at = self._last
            start = max(last_ends_at, last_called_at if is_chained else called_at)
        ends_at = start + duration_s
        self._last = (called_at, ends_at)
        return ends_at

    def idle(self) -> None:
        """Nothing ran: the next step starts afresh."""
        self._last = None
