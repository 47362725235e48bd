"""Helpers: the gateway under test served by uvicorn in the test's event loop, in front of the
FakeRouter test double or a real in-process router (all on 127.0.0.1, port 0)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

import uvicorn

from gateway.app import create_app
from gateway.cli import bind_socket
from gateway.settings import GatewaySettings


class RouterAtAddress(Protocol):
    @property
    def address(self) -> str: ...


@dataclass
class RunningGateway:
    router: Any  # the FakeRouterServer, or a real router (test_gateway_shared_stream)
    base_url: str
    server: uvicorn.Server
    task: asyncio.Task[None]

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, timeout=10)


async def start_gateway(router: RouterAtAddress, **overrides: Any) -> RunningGateway:
    settings = GatewaySettings(router=router.address, port=0, **overrides)
    sock = bind_socket("127.0.0.1", 0)
    config = uvicorn.Config(create_app(settings), log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    return RunningGateway(router, f"http://127.0.0.1:{sock.getsockname()[1]}", server, task)


