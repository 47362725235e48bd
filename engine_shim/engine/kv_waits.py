"""Starts that wait in the engine for their reservation's KV (start_generate with
`after_kv`): the shim hands the start over with the RemoteSend still running, and the engine
starts it in the loop turn the reservation's KV completes (a NIXL write's notification, the
last pushed chunk), with no round trip through the shim's event loop between the KV and the
first step. A reservation that ends first (an abort, its TTL) fails the start
FAILED_PRECONDITION, as the shim's own wait did. Shared by the engine and the synthetic one."""

from __future__ import annotations

import logging
from collections.abc import Callable

from .api import EngineError, FailedPreconditionError
from .disaggregation import StartFailed

logger = logging.getLogger(__name__)


class KVWaits:
    """The waiting starts of one engine, by request id, each kept as the call that starts
    it; a failure goes to `emit` as a StartFailed event (among the engine's own)."""

    def __init__(self, emit: Callable[[StartFailed], None]) -> None:
        self._emit = emit
        self._starts: dict[str, Callable[[], None]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._starts

    def __len__(self) -> int:
        return len(self._starts)

    def wait(self, request_id: str, start: Callable[[], None]) -> None:
        self._starts[request_id] = start

    def filled(self, request_id: str, release: Callable[[str], object]) -> None:
        """The reservation's KV is complete: its waiting start (if any) runs now. A start
        that fails here fails its request, and `release` ends the reservation it left."""
        start = self._starts.pop(request_id, None)
        if start is None:
            return
        try:
            start()
        except Exception as error:  # noqa: BLE001 - one request's failure, not the engine's
            if not isinstance(error, EngineError):
                logger.exception("a start waiting for its KV failed")
                error = EngineError(f"internal engine error: {error}")
            release(request_id)
            self._emit(StartFailed(request_id, error))

    def ended(self, request_id: str) -> None:
        """The reservation ended without its KV (aborted, expired): its waiting start fails."""
        if self._starts.pop(request_id, None) is not None:
            self._emit(StartFailed(request_id, FailedPreconditionError(
                f"the KV reservation for {request_id!r} ended before its KV arrived")))
