"""`serve(...)`: MLC's one-call launcher. Starts one engine shim per endpoint (embedded unless
an MLC model lib is given), this router (any Router subclass) on a gRPC port of its own, and
the OpenAI gateway on router_host:router_port. As MLC's router, it serves only once every
engine answers health (bounded by startup_timeout_s, naming an engine that never came up),
then prints one ready line. Blocks until Ctrl-C / SIGTERM, which stop everything quietly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

from microserving.stack.process import free_port
from router.router import Router
from router.server import start_router

logger = logging.getLogger(__name__)

_POLL_S = 0.25  # start-up of other processes: nothing to await but their health


class _Stopped(Exception):
    """Ctrl-C / SIGTERM arrived while starting."""


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
    # The children's own output stays quiet on Ctrl-C too: they get SIGINT from the terminal
    # and drain, so only their logs (not tracebacks) reach the console.
    return subprocess.Popen(list(command), env=os.environ.copy(), stdout=subprocess.DEVNULL)


class _Launch:
    """The processes serve() started and the waits between them."""

    def __init__(self, shims: dict[str, subprocess.Popen[bytes]], startup_timeout_s: float) -> None:
        self.shims = shims  # engine address -> its process
        self.processes: list[subprocess.Popen[bytes]] = list(shims.values())
        self.deadline_s = time.monotonic() + startup_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.stop = asyncio.Event()

    def _check_time(self, what: str) -> None:
        if self.stop.is_set():
            raise _Stopped
        if time.monotonic() > self.deadline_s:
            raise SystemExit(f"microserving serve: {what} within {self.startup_timeout_s:.0f} s "
                             "(startup_timeout_s)")

    async def engines_ready(self, router: Router) -> None:
        while True:
            missing = [e.address for e in router.registry.endpoints if not e.is_available]
            if not missing:
                return
            for address in missing:
                code = self.shims[address].poll() if address in self.shims else None
                if code is not None:
                    raise SystemExit(f"microserving serve: the engine on {address} exited "
                                     f"with code {code}")
            self._check_time(f"the engine on {missing[0]} did not answer health")
            await asyncio.sleep(_POLL_S)

    async def gateway_ready(self, gateway: subprocess.Popen[bytes], health_url: str) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(health_url)).status_code == 200:
                        return
                if gateway.poll() is not None:
                    raise SystemExit(f"microserving serve: the gateway exited with code "
                                     f"{gateway.returncode} (is {health_url} taken?)")
                self._check_time(f"the gateway ({health_url}) did not become healthy")
                await asyncio.sleep(_POLL_S)

    def terminate(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


async def _serve(launch: _Launch, router: Router, router_host: str, router_port: int) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, launch.stop.set)
    running = await start_router(router, router_host, free_port(router_host))
    try:
        await launch.engines_ready(router)
        gateway = start_process([
            sys.executable, "-m", "microserving.cli", "gateway",
            "--router", f"{router_host}:{running.port}", "--host", router_host,
            "--port", str(router_port)])
        launch.processes.append(gateway)
        base_url = f"http://{router_host}:{router_port}"
        await launch.gateway_ready(gateway, f"{base_url}/health")
        print(f"microserving serve: ready at {base_url}/v1 ({len(launch.shims)} engines, "
              f"router {type(router).__name__}); Ctrl-C stops", flush=True)
        await launch.stop.wait()
    except _Stopped:
        pass
    finally:
        await running.stop()


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
    startup_timeout_s: float = 600.0,
) -> None:
    """Launch shims, the router and the gateway; Ctrl-C stops them all."""
    roles = _roles(router_mode, len(endpoint_ports))
    shims = {
        f"{host}:{port}": start_process(
            _shim_command(model, model_lib, host, port, role, enable_prefix_cache))
        for host, port, role in zip(endpoint_hosts, endpoint_ports, roles, strict=True)
    }
    launch = _Launch(shims, startup_timeout_s)
    try:
        router = router_type(
            model, model_lib, endpoint_hosts, endpoint_ports, endpoint_num_gpus,
            enable_prefix_cache, router_mode, pd_balance_factor,
        )
        asyncio.run(_serve(launch, router, router_host, router_port))
    except KeyboardInterrupt:  # Ctrl-C before the loop's handler was installed
        pass
    finally:
        launch.terminate()
