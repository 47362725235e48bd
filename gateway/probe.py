"""The health probe command of the containers (the probes live in microserving.stack.health):
the gRPC health service of a shim or router, and the gateway's HTTP /health.

    python -m gateway.probe grpc 127.0.0.1:50051      # exit 0 when SERVING
    python -m gateway.probe http http://127.0.0.1:8000/health

The token / TLS of the gRPC hop are read from MICROSERVING_PROBE_TOKEN / _TLS_CA / _TLS_CERT /
_TLS_KEY (health stays callable without the token, see microserving.transport).
"""

from __future__ import annotations

import argparse
import sys

from microserving.stack.health import is_grpc_serving, is_http_healthy


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
