"""Bounded request bodies: a body over `max_body_bytes` is answered 413 before it is read (from
its Content-Length) or as soon as the bytes read pass the limit (chunked bodies), and a body
that does not arrive within `body_timeout_s` is answered 408. Nothing is parsed before the
whole body is in, so one huge or slow request costs the gateway at most the limit in memory
and never the event loop's time.

A pure ASGI middleware: it reads the body (up to the limit) and hands it on in one message;
every later `receive` (the disconnect watch of streamed responses) goes to the server as is.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import BODY_TIMEOUT, BODY_TOO_LARGE, GatewayError, render


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(scope, send, self._too_large())
            return
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation that
            # lands in the turn the read completes (the client gone, the request run anyway).
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read(receive)
        except _BodyTooLarge:
            await self._refuse(scope, send, self._too_large())
            return
        except TimeoutError:
            error = GatewayError(BODY_TIMEOUT, f"the request body did not arrive within "
                                              f"{self.body_timeout_s:g} s")
            await self._refuse(scope, send, error)
            return
        if body is None:
            return  # the client left while sending: nobody to answer
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> GatewayError:
        return GatewayError(BODY_TOO_LARGE, f"the request body is larger than the limit of "
                                            f"{self.max_body_bytes} bytes")

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body; None when the client disconnected first."""
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyTooLarge()
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    @staticmethod
    async def _refuse(scope: Scope, send: Send, error: GatewayError) -> None:
        # Counted by the metrics middleware outside this one (it sees the status it sends).
        # uvicorn discards the rest of the body as it arrives (the response is complete), so
        # a client still sending can read this answer; the header deadline (header_timeout.py)
        # closes a connection that keeps sending past it.
        await render(error)(scope, _no_body, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _no_body() -> Message:
    return {"type": "http.disconnect"}


def _replay(body: bytes, receive: Receive) -> Receive:
    is_sent = False

    async def replay() -> Message:
        nonlocal is_sent
        if not is_sent:
            is_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
