"""A deadline on request headers: a connection that has no request in progress (just opened,
or between keep-alive requests) and has not completed a request's headers within
`header_timeout_s` is closed. uvicorn itself only times out idle keep-alive connections after
a response; a client that connects and sends nothing, or trickles a header line by line,
would otherwise hold its connection (and a file descriptor) forever.

Also answers requests the HTTP parser refuses with an OpenAI error body.

In the single process the CLI passes the class; the worker processes of `--workers N` import
`worker_protocol` by name. Works with uvicorn's h11 and httptools protocols alike: both set `cycle` when a request's
headers are complete and call `on_response_complete` when its response is sent.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string


def header_timeout_protocol(header_timeout_s: float, http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's protocol class for `http` with the header deadline added."""
    base: Any = import_from_string(HTTP_PROTOCOLS[http])

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._on_header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def send_400_response(self, msg: str) -> None:
            """A request the HTTP parser refuses (e.g. control characters in a header) gets
            an OpenAI error body like every other 400, not uvicorn's plain text."""
            body = json.dumps({"error": {"message": msg, "type": "invalid_request_error",
                                         "param": None, "code": "invalid_http_request"}}).encode()
            head = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body))
            self.transport.write(head + body)
            self.transport.close()

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            cycle = getattr(self, "cycle", None)
            is_serving = cycle is not None and not cycle.response_complete
            if not is_serving and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


# What a worker process's uvicorn imports as its protocol (`--workers N`): the supervisor
# hands workers a picklable config, so the protocol is named, not passed as a class.
WORKER_PROTOCOL = "gateway.header_timeout:worker_protocol"


def worker_protocol(*args: Any, **kwargs: Any) -> asyncio.Protocol:
    """uvicorn's protocol factory in a worker process: the header deadline from the worker's
    settings (made once per process)."""
    return _worker_protocol_class()(*args, **kwargs)


@functools.cache
def _worker_protocol_class() -> type[asyncio.Protocol]:
    from gateway.settings import settings_from_worker_env

    return header_timeout_protocol(settings_from_worker_env().header_timeout_s)
