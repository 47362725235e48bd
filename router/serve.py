"""`serve(...)`: MLC's one-call launcher. Starts one engine shim per endpoint (embedded unless
an MLC model lib is given), this router (any Router subclass) on a gRPC port of its own, and
the OpenAI gateway on router_host:router_port. Blocks until interrupted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence

from router.router import Router
from router.server import serve_forever

logger = logging.getLogger(__name__)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _shim_command(
    model: str, model_lib: str | None, host: str, port: int, role: str, enable_prefix_cache: bool
) -> list[str]:
    # As MLC's serve: enable_prefix_cache=False starts engines with the prefix cache off (the
    # tutorial relies on it: it always remote_sends from 0, so a cache hit would not fit).
    command = [sys.executable, "-m", "microserving.cli", "shim", "--model", model,
               "--host", host, "--port", str(port), "--role", role,
               "--enable-prefix-cache", "true" if enable_prefix_cache else "false"]
    if model_lib:
        command += ["--backend", "mlc", "--mlc-model-lib", model_lib]
    else:
        command += ["--backend", "embedded"]
    return command


def _roles(router_mode: str, num_endpoints: int) -> list[str]:
    if router_mode == "disagg":
        return ["prefill"] + ["decode"] * (num_endpoints - 1)
    return ["both"] * num_endpoints


def start_process(command: Sequence[str]) -> subprocess.Popen[bytes]:
    logger.info("starting %s", " ".join(command))
    return subprocess.Popen(list(command), env=os.environ.copy())


def serve(
    model: str,
    model_lib: str | None = None,
    router_host: str = "127.0.0.1",
    router_port: int = 8000,
    endpoint_hosts: Sequence[str] = ("127.0.0.1",),
    endpoint_ports: Sequence[int] = (8080,),
    endpoint_num_gpus: Sequence[int] = (1,),
    enable_prefix_cache: bool = False,
    router_mode: str = "disagg",
    pd_balance_factor: float = 0.0,
    router_type: type[Router] = Router,
) -> None:
    """Launch shims, the router and the gateway; Ctrl-C stops them all."""
    roles = _roles(router_mode, len(endpoint_ports))
    processes = [
        start_process(_shim_command(model, model_lib, host, port, role, enable_prefix_cache))
        for host, port, role in zip(endpoint_hosts, endpoint_ports, roles, strict=True)
    ]
    grpc_port = _free_port(router_host)
    try:
        router = router_type(
            model, model_lib, endpoint_hosts, endpoint_ports, endpoint_num_gpus,
            enable_prefix_cache, router_mode, pd_balance_factor,
        )
        processes.append(start_process([
            sys.executable, "-m", "microserving.cli", "gateway", "--router", f"{router_host}:{grpc_port}",
            "--host", router_host, "--port", str(router_port),
        ]))
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve_forever(router, router_host, grpc_port))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()

