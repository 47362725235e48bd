"""The admission limit: at most `max_inflight` generation requests at once; the rest get 429."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gateway.errors import OVERLOADED, GatewayError


class AdmissionLimit:
    def __init__(self, max_inflight: int) -> None:
        self.max_inflight = max_inflight  # 0: unlimited
        self.num_inflight = 0

    def acquire(self) -> None:
        if self.max_inflight and self.num_inflight >= self.max_inflight:
            raise GatewayError(OVERLOADED, f"too many requests in flight (limit {self.max_inflight});"
                               " retry later")
        self.num_inflight += 1

    def release(self) -> None:
        self.num_inflight -= 1

    @contextmanager
    def slot(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()
