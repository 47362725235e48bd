"""Builds and runs the router's gRPC server: Router service, grpc.health.v1 (SERVING only
while at least one engine of every role the pattern needs is healthy) and reflection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass

from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from microserving.gc_tuning import freeze_startup_heap
from microserving.metrics import MetricsServer, serve_metrics
from microserving.reflection import enable_server_reflection
from microserving.transport import add_port, create_server
from microserving.v1 import router_pb2, router_pb2_grpc
from router.endpoint import DECODE, PREFILL, Endpoint
from router.router import Router
from router.servicer import RouterServicer

logger = logging.getLogger(__name__)

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


def needed_roles(pattern: str) -> tuple[int, ...]:
    """Roles that must each have a healthy engine for the pattern to serve."""
    return (PREFILL, DECODE) if pattern == "disagg" else (DECODE,)


def can_serve(router: Router) -> bool:
    """A healthy engine of every role the router's pattern needs (its grpc.health.v1)."""
    return all(router.registry.has_available(role) for role in needed_roles(router.router_mode))


def serve_router_metrics(router: Router, host: str) -> MetricsServer | None:
    """The router's Prometheus /metrics on host:`metrics_port` when its settings give one
    (0 picks a port), announced on stdout."""
    port = router.settings.metrics_port
    if port is None:
        return None
    metrics = serve_metrics(router.metrics.registry, host, port)
    print(f"microserving router metrics on http://{host}:{metrics.port}/metrics", flush=True)
    return metrics


@dataclass
class RunningRouter:
    router: Router
    server: aio.Server
    port: int
    health: health.aio.HealthServicer

    async def stop(self, grace_s: float | None = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        await self.router.stop()


async def start_router(router: Router, host: str, port: int) -> RunningRouter:
    """Start `router` and serve it on host:port (0 picks a port); returns once serving."""
    settings = router.settings
    server = create_server(settings.transport)
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(router), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_server_reflection((ROUTER_SERVICE, health.SERVICE_NAME), server)
    bound = add_port(server, f"{host}:{port}", settings.transport)
    loop = asyncio.get_running_loop()

    def publish_health(endpoint: Endpoint | None = None, previous: int = 0) -> None:
        del endpoint, previous
        status = health_pb2.HealthCheckResponse.SERVING if can_serve(router) else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", ROUTER_SERVICE):
            loop.create_task(health_servicer.set(service, status))

    router.registry.add_listener(publish_health)
    await router.start()
    publish_health()
    await server.start()
    return RunningRouter(router=router, server=server, port=bound, health=health_servicer)


async def serve_forever(router: Router, host: str, port: int) -> None:
    """Run until SIGINT/SIGTERM, printing the bound address once serving."""
    running = await start_router(router, host, port)
    freeze_startup_heap()
    metrics = serve_router_metrics(router, host)
    print(f"microserving router listening on {host}:{running.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.stop()
    if metrics is not None:
        metrics.stop()
