"""`x-request-id`: a client's id for its request (kept when it is 1..128 printable ASCII
characters) or one the gateway makes up, returned on every response as the same header and
handed to the handler as `request.state.request_id`, so the client's id, the gateway's log
lines and the trace of the request can be matched."""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
_VALID = re.compile(rb"^[\x21-\x7e]{1,128}$")


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for key, value in scope["headers"] if key == HEADER), b"")
        request_id = given if _VALID.match(given) else uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = request_id.decode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (HEADER, request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)
