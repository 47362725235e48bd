"""The gateway's only link to the router: one long-lived gRPC channel shared by all requests.

Each HTTP request opens one `Router.Generate` stream on the shared channel and may start several
router requests on it (one per prompt). Closing the `GenerateStream` cancels the call, which
cancels every router request on it; the router aborts the engines' work. The channel reconnects
by itself when the router restarts (short reconnect backoff below).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from microserving.transport import TransportSettings, create_channel
from microserving.v1 import router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
)


class GenerateStream:
    """One Router.Generate call: write NewRequests, read their events, cancel on close."""

    def __init__(self, call: aio.StreamStreamCall) -> None:
        self._call = call
        self._open_ids: set[str] = set()

    async def start(self, requests: Sequence[router_pb2.NewRequest]) -> None:
        for request in requests:
            self._open_ids.add(request.request_id)
            try:
                await self._call.write(router_pb2.GenerateRequest(generate=request))
            except aio.AioRpcError as error:
                # The router reports request errors in-band, so a write that fails with
                # INTERNAL is grpc core's "Internal error from Core": the connection broke
                # (router killed or restarting) and the client should retry: UNAVAILABLE.
                if error.code() is not grpc.StatusCode.INTERNAL:
                    raise
                raise aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, aio.Metadata(), aio.Metadata(),
                                      "the router connection broke") from None
        # No half-close here: the router cancels a stream's requests when the client side closes.

    async def events(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Every event until each started request has sent `done` or `error`."""
        while self._open_ids:
            event = await self._call.read()
            if event is aio.EOF:
                raise aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, aio.Metadata(), aio.Metadata(),
                                      "router closed the stream early")
            assert isinstance(event, router_pb2.GenerateResponse)
            if event.WhichOneof("event") in ("done", "error"):
                self._open_ids.discard(event.request_id)
            yield event

    def close(self) -> None:
        """Cancels the call if any request is still open (client gone, error, shutdown)."""
        if not self._call.done():
            logger.debug("cancelling router requests %s", sorted(self._open_ids))
            self._call.cancel()

    async def __aenter__(self) -> GenerateStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._open_ids or exc is not None:
            self.close()
            return
        with contextlib.suppress(aio.AioRpcError):  # all finished: end the call politely
            await self._call.done_writing()


class RouterClient:
    def __init__(self, address: str, transport: TransportSettings) -> None:
        self.address = address
        self._channel = create_channel(address, transport, _CHANNEL_OPTIONS)
        self._router = router_pb2_grpc.RouterStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def open_stream(self) -> GenerateStream:
        return GenerateStream(self._router.Generate())

    async def list_models(self, timeout_s: float = 5.0) -> router_pb2.ListModelsResponse:
        return await self._router.ListModels(router_pb2.ListModelsRequest(), timeout=timeout_s)

    async def get_status(self, timeout_s: float = 5.0) -> router_pb2.RouterGetStatusResponse:
        return await self._router.GetStatus(router_pb2.RouterGetStatusRequest(), timeout=timeout_s)

    async def is_serving(self, timeout_s: float) -> bool:
        """The router's grpc.health.v1 status: SERVING means it can run its pattern."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""),
                                             timeout=timeout_s)
        except aio.AioRpcError as error:
            logger.debug("router health check failed: %s", error.code().name)
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        await self._channel.close()
