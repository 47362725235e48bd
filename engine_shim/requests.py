"""The shim's own view of request ids, so out-of-order calls are refused before the engine
sees them (on MLC such a call kills the engine loop): duplicates, StartGenerate with begin > 0
and no live PrepRecv, and reservations the engine's TTL has reclaimed."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine_shim.engine.api import AlreadyExistsError, FailedPreconditionError


@dataclass
class _Reservation:
    end: int
    expires_at_s: float
    num_holds: int = 0  # KV pushes, writes and HoldKVs open on it: it does not expire meanwhile


class RequestTracker:
    """Tracks which ids are reserved (PrepRecv), generating or sending on this shim."""

    def __init__(self, reservation_ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self._ttl_s = reservation_ttl_s
        self._clock = clock
        self._reserved: dict[str, _Reservation] = {}
        self._generating: set[str] = set()
        self._sending: set[str] = set()
        self._preparing: set[str] = set()

    def _live_reservation(self, request_id: str) -> _Reservation | None:
        reservation = self._reserved.get(request_id)
        if reservation is not None and reservation.expires_at_s <= self._clock():
            del self._reserved[request_id]
            return None
        return reservation

    def _is_receiving(self, request_id: str) -> bool:
        return (
            request_id in self._preparing
            or request_id in self._generating
            or self._live_reservation(request_id) is not None
        )

    def begin_prep_recv(self, request_id: str) -> None:
        if self._is_receiving(request_id):
            raise AlreadyExistsError(f"request {request_id!r} is already active")
        self._preparing.add(request_id)

    def end_prep_recv(self, request_id: str, end: int | None) -> None:
        """`end` is the reserved window end, or None when prep_recv failed."""
        self._preparing.discard(request_id)
        if end is not None:
            self._reserved[request_id] = _Reservation(end, self._clock() + self._ttl_s)

    def begin_generate(self, request_id: str, begin: int) -> None:
        if request_id in self._generating or request_id in self._preparing:
            raise AlreadyExistsError(f"request {request_id!r} is already active")
        reservation = self._live_reservation(request_id)
        if begin > 0 and reservation is None:
            raise FailedPreconditionError(
                f"start_generate with begin={begin} needs a live prep_recv for {request_id!r}"
            )
        self._reserved.pop(request_id, None)
        self._generating.add(request_id)

    def end_generate(self, request_id: str) -> None:
        self._generating.discard(request_id)

    def begin_remote_send(self, request_id: str) -> None:
        if request_id in self._sending:
            raise AlreadyExistsError(f"request {request_id!r} is already sending")
        self._sending.add(request_id)

    def end_remote_send(self, request_id: str) -> None:
        self._sending.discard(request_id)

    def hold(self, request_id: str, is_held: bool) -> None:
        """A KV push, write or HoldKV on the reservation began (it does not expire while one
        is open) or ended (its TTL starts again once none is); the engine holds its own copy
        alike."""
        reservation = self._reserved.get(request_id)
        if reservation is None:
            return
        reservation.num_holds = reservation.num_holds + 1 if is_held else max(0, reservation.num_holds - 1)
        reservation.expires_at_s = math.inf if reservation.num_holds else self._clock() + self._ttl_s

    def forget(self, request_id: str) -> None:
        """After an abort: the id holds nothing any more (a running stream ends by itself)."""
        self._reserved.pop(request_id, None)

    @property
    def num_in_flight(self) -> int:
        return len(self._generating) + len(self._sending) + len(self._preparing)
