"""The shim process: one grpc.aio server with the Engine service, the KVTransfer data plane
(embedded backend), grpc.health.v1 and reflection; start-up (NOT_SERVING until the engine is
loaded and warm) and drain on shutdown (NOT_SERVING, then `server.stop(grace)`)."""

from __future__ import annotations

import asyncio
import logging

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from engine_shim.backend import Backend, KVTransferService
from engine_shim.metrics import ShimMetrics
from engine_shim.requests import RequestTracker
from engine_shim.servicer import EngineServicer
from engine_shim.settings import ShimSettings
from microserving.metrics import MetricsServer, serve_metrics
from microserving.reflection import enable_server_reflection
from microserving.transport import add_port, create_server
from microserving.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
KV_TRANSFER_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name


def make_backend(settings: ShimSettings) -> Backend:
    if settings.backend == "embedded":
        from engine_shim.backends.embedded.backend import EmbeddedBackend

        return EmbeddedBackend(settings)
    if settings.backend == "synthetic":  # benchmark only
        from engine_shim.backends.synthetic.backend import SyntheticBackend

        return SyntheticBackend(settings)
    from engine_shim.backends.mlc.backend import MLCBackend

    return MLCBackend(settings)


class ShimServer:
    """Build with settings (and optionally a backend), `start()`, later `stop()`."""

    def __init__(self, settings: ShimSettings, backend: Backend | None = None) -> None:
        self.settings = settings
        self.backend = backend or make_backend(settings)
        self.health = HealthServicer()
        self.servicer = EngineServicer(
            self.backend,
            RequestTracker(settings.reservation_ttl_s),
            role=settings.role,
            max_prompt_tokens=settings.max_prompt_tokens,
            stream_interval_s=settings.stream_interval_ms / 1e3,
            stream_updates_per_s=settings.stream_updates_per_s,
        )
        self.metrics = ShimMetrics(self.backend, settings.role)
        self.metrics_server: MetricsServer | None = None
        self._server: aio.Server | None = None
        self._kv_servicer: KVTransferService | None = None
        self._service_names = ["", ENGINE_SERVICE]
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    def _build(self) -> aio.Server:
        server = create_server(self.settings.transport())
        engine_pb2_grpc.add_EngineServicer_to_server(self.servicer, server)
        kv_servicer = self._kv_servicer = \
            self.backend.kv_transfer_servicer(on_hold=self.servicer.hold_reservation)
        if kv_servicer is not None:
            kv_servicer.add_to_server(server)
            self._service_names.append(KV_TRANSFER_SERVICE)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [
            *self._service_names[1:],
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        ]
        enable_server_reflection(names, server)
        return server

    async def _set_health(
        self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType
    ) -> None:
        for name in self._service_names:
            await self.health.set(name, status)

    async def start(self) -> int:
        """Bind, serve NOT_SERVING while the engine loads and warms up, then SERVING."""
        self._server = self._build()
        self.port = add_port(
            self._server, f"{self.settings.host}:{self.settings.port}", self.settings.transport()
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.start()
        self.metrics.bind(asyncio.get_running_loop())
        if self.settings.metrics_port is not None:
            self.metrics_server = serve_metrics(self.metrics.registry, self.settings.host,
                                                self.settings.metrics_port)
        await self.backend.start(self.settings.advertise_address or self.address)
        self.servicer.is_ready = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: refuse new work, give in-flight calls `grace_s`, then stop the engine."""
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        self.servicer.is_draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._kv_servicer is not None:
            self._kv_servicer.drain()
        if self._server is not None:
            await self._server.stop(grace)
        await self.backend.shutdown()
        if self.metrics_server is not None:
            self.metrics_server.stop()
