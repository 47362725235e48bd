"""Health probes for containers and for `microserving up`: the gRPC health service of a shim or
router, and the gateway's HTTP /health.

    python -m gateway.probe grpc 127.0.0.1:50051      # exit 0 when SERVING
    python -m gateway.probe http http://127.0.0.1:8000/health

The token / TLS of the gRPC hop are read from MICROSERVING_PROBE_TOKEN / _TLS_CA / _TLS_CERT /
_TLS_KEY (health stays callable without the token, see microserving.transport).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.probe")
    parser.add_argument("kind", choices=["grpc", "http"])
    parser.add_argument("target", help="host:port (grpc) or URL (http)")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    probe = is_grpc_serving if args.kind == "grpc" else is_http_healthy
    healthy = probe(args.target, args.timeout_s)
    print("SERVING" if healthy else "NOT SERVING")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
