"""The MLC-wire-compatible server in process on port 0, behind an ASGI hook that records the
JSON of every call (what MLC's engine would have been sent, and what it answered)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import uvicorn

from engine_shim.mlc_http.app import create_app
from engine_shim.mlc_http.cli import bind
from engine_shim.mlc_http.settings import MLCCompatSettings


class Recorder:
    """ASGI hook: keeps (path, request JSON, response bytes) of every HTTP call."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.calls: list[tuple[str, Any, bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body: list[bytes] = []
        reply: list[bytes] = []

        async def recording_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        async def recording_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                reply.append(message.get("body", b""))
            await send(message)

        await self.app(scope, recording_receive, recording_send)
        raw = b"".join(body)
        is_json = scope["path"].startswith(
            ("/microserving/prep", "/microserving/remote", "/microserving/start", "/v1/")
        )
        self.calls.append(
            (scope["path"], json.loads(raw) if raw and is_json else raw, b"".join(reply))
        )

    def bodies(self, path: str) -> list[tuple[Any, bytes]]:
        return [(request, reply) for p, request, reply in self.calls if p == path]


class CompatServer:
    def __init__(self, settings: MLCCompatSettings) -> None:
        self.recorder = Recorder(create_app(settings))
        self.socket = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.recorder, log_level="warning"))
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
