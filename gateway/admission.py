"""The admission limit: at most `max_inflight` units of generation work at once, a request
counting one unit per completion it asks for (prompts x n), so one request carrying
thousands of prompts cannot pass as one; the rest get 429. A request asking for more
completions than `max_choices` is refused outright (400)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gateway.errors import INVALID, OVERLOADED, GatewayError


class AdmissionLimit:
    def __init__(self, max_inflight: int, max_choices: int = 256) -> None:
        self.max_inflight = max_inflight  # 0: unlimited
        self.max_choices = max_choices
        self.num_inflight = 0

    def acquire(self, num_choices: int = 1) -> int:
        """Admits a request of `num_choices` completions; -> the units to release later."""
        if num_choices > self.max_choices:
            raise GatewayError(INVALID, f"the request asks for {num_choices} completions "
                               f"(prompts x n); at most {self.max_choices} are served per request")
        # Capped at the limit, so a large request can still run alone on an idle gateway.
        units = min(num_choices, self.max_inflight) if self.max_inflight else num_choices
        if self.max_inflight and self.num_inflight + units > self.max_inflight:
            raise GatewayError(OVERLOADED, f"too many requests in flight (limit {self.max_inflight});"
                               " retry later")
        self.num_inflight += units
        return units

    def release(self, units: int = 1) -> None:
        self.num_inflight -= units

    @contextmanager
    def slot(self, num_choices: int = 1) -> Iterator[None]:
        units = self.acquire(num_choices)
        try:
            yield
        finally:
            self.release(units)
