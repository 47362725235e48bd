"""Client-disconnect handling: work bound to an HTTP request stops when its client goes away.

`run_until_disconnect` races the work against the ASGI `http.disconnect` message (an awaited
event, not polling); `RelayResponse` is a StreamingResponse that always runs its cleanup, even
when Starlette cancels the stream because the client left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, or ClientDisconnected (with `work` cancelled) if the client left."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task.done():
            return work_task.result()
        raise ClientDisconnected()
    finally:
        watch_task.cancel()
        work_task.cancel()


class RelayResponse(StreamingResponse):
    """A streaming response whose `on_close` runs however the stream ends."""

    def __init__(self, content: object, on_close: Callable[[], None], **kwargs: object) -> None:
        super().__init__(content, **kwargs)  # type: ignore[arg-type]
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
