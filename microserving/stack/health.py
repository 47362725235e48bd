"""Health probes of the services: the gRPC health service of a shim or router, and the
gateway's HTTP /health. `microserving up` waits on them; `python -m gateway.probe` (the
containers' health checks) runs them."""

from __future__ import annotations

import asyncio
import os
import urllib.error
import urllib.request

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from microserving.transport import TransportSettings, create_channel


def _transport_from_env() -> TransportSettings:
    env = os.environ
    return TransportSettings(tls_ca=env.get("MICROSERVING_PROBE_TLS_CA"),
                             tls_cert=env.get("MICROSERVING_PROBE_TLS_CERT"),
                             tls_key=env.get("MICROSERVING_PROBE_TLS_KEY"),
                             token=env.get("MICROSERVING_PROBE_TOKEN"))


async def grpc_status(address: str, timeout_s: float, transport: TransportSettings,
                      service: str = "") -> str:
    """The grpc.health.v1 status name of `address`, or the gRPC error code name."""
    async with create_channel(address, transport) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                     timeout=timeout_s)
        except aio.AioRpcError as error:
            return str(error.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def is_grpc_serving(address: str, timeout_s: float = 2.0,
                    transport: TransportSettings | None = None) -> bool:
    """SERVING or not; `transport` defaults to the MICROSERVING_PROBE_* environment."""
    status = asyncio.run(grpc_status(address, timeout_s, transport or _transport_from_env()))
    return status == "SERVING"


def is_http_healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False
