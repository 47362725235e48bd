"""Engine addresses from the command line and from DNS names re-resolved on an interval
(a Kubernetes headless Service resolves to one A record per ready pod)."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

from router.endpoint import ROLE_NAMES
from router.registry import EngineRegistry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """HOST:PORT[=ROLE]; roles None means 'as the engine reports'."""

    address: str
    roles: frozenset[int] | None


def parse_engine_spec(spec: str) -> EngineSpec:
    address, _, role = spec.partition("=")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"engine {spec!r} must look like HOST:PORT[=prefill|decode|both]")
    if role and role not in ROLE_NAMES:
        raise ValueError(f"engine {spec!r}: role must be one of {sorted(ROLE_NAMES)}")
    return EngineSpec(address=address, roles=frozenset({ROLE_NAMES[role]}) if role else None)


def format_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def resolve(name: str, port: int) -> set[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return {format_address(str(info[4][0]), port) for info in infos}


class DnsWatcher:
    """Keeps the registry's engines of one DNS name equal to what the name resolves to."""

    def __init__(self, registry: EngineRegistry, spec: str, interval_s: float) -> None:
        parsed = parse_engine_spec(spec)
        self._name, _, port = parsed.address.rpartition(":")
        self._port = int(port)
        self._roles = parsed.roles
        self._registry = registry
        self._interval_s = interval_s
        self.source = f"dns:{parsed.address}"

    async def refresh(self) -> None:
        try:
            addresses = await resolve(self._name, self._port)
        except OSError as exc:
            # A failed lookup keeps the engines we have: DNS hiccups must not empty the pool.
            logger.warning("resolving %s failed: %s", self._name, exc)
            return
        await self._registry.sync_source(self.source, addresses, self._roles)

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._interval_s)
