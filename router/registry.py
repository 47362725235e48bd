"""The engine registry: which engines exist, which are healthy, how loaded they are.

Each engine has a monitor task that checks grpc.health.v1 (Check with a deadline) and polls
GetStatus on an interval. A failed check, a failed call or a stall marks the engine
UNREACHABLE (out of rotation); the next good check puts it back, and a failed call brings
that check forward (RECHECK_AFTER_FAILURE_S), so an engine that only failed one call is back
at once. Engines join and leave at runtime through add()/remove() (static addresses, or DNS
via discovery.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2

from microserving.transport import TransportSettings
from microserving.v1 import engine_pb2, router_pb2
from router.endpoint import Endpoint

logger = logging.getLogger(__name__)

_SERVING = router_pb2.ENGINE_HEALTH_SERVING
_NOT_SERVING = router_pb2.ENGINE_HEALTH_NOT_SERVING
_UNREACHABLE = router_pb2.ENGINE_HEALTH_UNREACHABLE

# A call that failed takes its engine out of rotation, and its next check comes this soon
# after, not a whole interval later: an engine that answers (a KV write that timed out under
# load, one request's failure) is back in rotation at once, where with one engine of a role
# every request in the interval had got "no healthy engine" (HTTP 503). A dead or stalled
# engine fails that check too and stays out.
RECHECK_AFTER_FAILURE_S = 0.05


class EngineRegistry:
    def __init__(
        self,
        transport: TransportSettings,
        *,
        health_interval_s: float = 1.0,
        health_timeout_s: float = 2.0,
    ) -> None:
        self._transport = transport
        self._interval_s = health_interval_s
        self._timeout_s = health_timeout_s
        self._endpoints: dict[str, Endpoint] = {}
        self._monitors: dict[str, asyncio.Task[None]] = {}
        self._wakes: dict[str, asyncio.Event] = {}  # set: the monitor checks now
        self._listeners: list[Callable[[Endpoint, int], None]] = []
        self._is_started = False

    # ---- membership ----
    def add(
        self, address: str, roles: frozenset[int] | None = None, *, num_gpus: int = 1,
        source: str = "static",
    ) -> Endpoint:
        """Register an engine (idempotent for a known address)."""
        if address in self._endpoints:
            return self._endpoints[address]
        endpoint = Endpoint(address=address, configured_roles=roles, num_gpus=num_gpus, source=source)
        self._endpoints[address] = endpoint
        if self._is_started:  # channels bind to the running loop: connect inside it
            endpoint.connect(self._transport)
            self._start_monitor(endpoint)
        logger.info("engine %s joined (%s)", address, source)
        return endpoint

    async def remove(self, address: str) -> None:
        """Take an engine out: no new requests; its channel closes once nothing is in flight."""
        endpoint = self._endpoints.pop(address, None)
        if endpoint is None:
            return
        endpoint.is_removed = True
        monitor = self._monitors.pop(address, None)
        if monitor is not None:
            monitor.cancel()
        self._wakes.pop(address, None)
        logger.info("engine %s left", address)
        asyncio.get_running_loop().create_task(self._close_when_idle(endpoint))

    async def sync_source(self, source: str, addresses: Iterable[str], roles: frozenset[int] | None) -> None:
        """Make the engines of `source` (e.g. one DNS name) exactly `addresses`."""
        wanted = set(addresses)
        for address in [a for a, e in self._endpoints.items() if e.source == source and a not in wanted]:
            await self.remove(address)
        for address in sorted(wanted):
            self.add(address, roles, source=source)

    @staticmethod
    async def _close_when_idle(endpoint: Endpoint, max_wait_s: float = 600.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_wait_s
        while endpoint.num_inflight and loop.time() < deadline:
            await asyncio.sleep(0.5)  # draining a departed engine; bounded
        await endpoint.close()

    # ---- queries ----
    @property
    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def get(self, address: str) -> Endpoint | None:
        return self._endpoints.get(address)

    def candidates(self, role: int, exclude: Iterable[str] = ()) -> list[Endpoint]:
        excluded = set(exclude)
        return [
            e for e in self._endpoints.values()
            if e.is_available and role in e.roles and e.address not in excluded
        ]

    def has_available(self, role: int) -> bool:
        return bool(self.candidates(role))

    @property
    def max_context_length(self) -> int | None:
        lengths = [e.status.max_context_length for e in self._endpoints.values()
                   if e.status is not None and e.status.max_context_length > 0]
        return min(lengths) if lengths else None

    # ---- health ----
    def add_listener(self, listener: Callable[[Endpoint, int], None]) -> None:
        """Called with (endpoint, previous health) whenever an engine's health changes."""
        self._listeners.append(listener)

    def set_health(self, endpoint: Endpoint, health: int) -> None:
        previous = endpoint.health
        if previous == health:
            return
        endpoint.health = health
        logger.info("engine %s health %s -> %s", endpoint.address,
                    router_pb2.EngineHealth.Name(previous), router_pb2.EngineHealth.Name(health))  # type: ignore[arg-type]
        for listener in self._listeners:
            listener(endpoint, previous)

    def mark_failed(self, address: str) -> None:
        """A call to the engine failed or stalled: out of rotation until a good check, which
        comes RECHECK_AFTER_FAILURE_S from now."""
        endpoint = self._endpoints.get(address)
        if endpoint is not None:
            self.set_health(endpoint, _UNREACHABLE)
            wake = self._wakes.get(address)
            if wake is not None:
                asyncio.get_running_loop().call_later(RECHECK_AFTER_FAILURE_S, wake.set)

    async def check_now(self, endpoint: Endpoint) -> None:
        """One health check plus status poll."""
        try:
            reply = await endpoint.health_stub.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self._timeout_s
            )
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                self.set_health(endpoint, _NOT_SERVING)
                return
            # Every poll tells the engine its KV peers: the engines registered here.
            request = engine_pb2.GetStatusRequest(kv_peers=list(self._endpoints))
            status = await endpoint.stub.GetStatus(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.debug("engine %s check failed: %s", endpoint.address, exc.code())
            self.set_health(endpoint, _UNREACHABLE)
            return
        endpoint.update_status(status)
        self.set_health(endpoint, _NOT_SERVING if status.is_draining else _SERVING)

    async def _monitor(self, endpoint: Endpoint, wake: asyncio.Event, is_checked: bool) -> None:
        """A check every interval, or sooner when `wake` is set (a failed call); the first
        one at once unless `is_checked` (start() has just checked every engine)."""
        try:
            if is_checked:
                await self._sleep(wake)
            while True:
                await self.check_now(endpoint)
                wake.clear()  # a failure during the check is judged by the check itself
                await self._sleep(wake)
        finally:
            if self._wakes.get(endpoint.address) is wake:
                del self._wakes[endpoint.address]

    async def _sleep(self, wake: asyncio.Event) -> None:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the inner result when
        # the cancellation and the wake-up land in one turn of the loop, and a monitor that
        # lost its cancellation kept `stop()` waiting forever.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._interval_s):
                await wake.wait()

    def _start_monitor(self, endpoint: Endpoint, is_checked: bool = False) -> None:
        wake = self._wakes[endpoint.address] = asyncio.Event()
        self._monitors[endpoint.address] = asyncio.get_running_loop().create_task(
            self._monitor(endpoint, wake, is_checked), name=f"monitor {endpoint.address}"
        )

    async def start(self) -> None:
        """Start monitoring; returns after one check of every engine."""
        self._is_started = True
        for endpoint in self._endpoints.values():
            endpoint.connect(self._transport)
        await asyncio.gather(*(self.check_now(e) for e in self._endpoints.values()))
        for endpoint in self._endpoints.values():
            self._start_monitor(endpoint, is_checked=True)

    async def stop(self) -> None:
        for monitor in self._monitors.values():
            monitor.cancel()
        for monitor in self._monitors.values():
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
        self._monitors.clear()
        await asyncio.gather(*(e.close() for e in self._endpoints.values()))
