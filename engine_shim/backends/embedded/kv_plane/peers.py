"""The addresses this shim may push KV to: the ones it was configured with, and the engines a
router told it about in its status polls (GetStatusRequest.kv_peers), each for a while after
it was last told. A RemoteSend whose kv_addr_info names anything else is refused before a
connection is made, so neither KV nor the shared token goes to an address outside the
deployment. Bounded: at most `max_told` told addresses, the stalest dropped first."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from engine_shim.engine.api import PermissionDeniedError

DEFAULT_MAX_TOLD = 4096


class PeerAllowList:
    def __init__(
        self,
        configured: Iterable[str],
        told_ttl_s: float,
        max_told: int = DEFAULT_MAX_TOLD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._configured = frozenset(configured)
        self._told_ttl_s = told_ttl_s
        self._max_told = max_told
        self._clock = clock
        self._told: OrderedDict[str, float] = OrderedDict()  # address -> expiry, oldest first

    def tell(self, addresses: Iterable[str]) -> None:
        """A router's registered engines, as of now."""
        expires_at_s = self._clock() + self._told_ttl_s
        for address in addresses:
            self._told.pop(address, None)
            self._told[address] = expires_at_s
        self._prune()

    def check(self, address: str) -> None:
        """Raises PermissionDeniedError unless KV may go to `address`."""
        self._prune()
        if address not in self._configured and address not in self._told:
            raise PermissionDeniedError(
                f"kv_addr_info names {address!r}, which is not a known peer of this engine "
                "(configured, or registered with a router that polls it)")

    @property
    def num_told(self) -> int:
        return len(self._told)

    def _prune(self) -> None:
        now = self._clock()
        while self._told and (len(self._told) > self._max_told
                              or next(iter(self._told.values())) <= now):
            self._told.popitem(last=False)
