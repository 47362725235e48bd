"""A router run inside its caller's process: no gRPC hop to reach it.

`InProcessRouter` runs a `Router` on the caller's event loop and answers what the gateway
asks of a router over gRPC (`gateway.router_client.RouterLink`): open a stream of requests,
list the models, say whether it can serve. `microserving serve` (colocated/) puts it in the
gateway's process, the way MLC's router is itself the HTTP server.

Each stream's requests run as tasks (`RequestHost.run`, as the Generate RPC runs them) that
write into an `Outbox` of the stream's own; the caller's task takes whatever queued since
its last turn. The events and their merging are those the router's GenerateBatched stream
would have carried, without their serialization, the two gRPC cores and a process hop per
engine step. Everything past the router (engine streams, PrepRecv/RemoteSend, retries and
resumption) is unchanged.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import grpc
from grpc import aio

from microserving.metrics import MetricsServer
from microserving.v1 import router_pb2
from router.errors import RouterError
from router.outbox import Outbox
from router.router import Router
from router.server import can_serve, serve_router_metrics
from router.servicer import RequestHost, list_models, put_error

logger = logging.getLogger(__name__)

_LAST_EVENTS = ("done", "error")


class _InternalError(RouterError):
    """A request task that failed without its last event (a bug): INTERNAL, not a hang."""


class InProcessStream:
    """One caller's router requests (one HTTP request's prompts), run in this process."""

    def __init__(self, host: RequestHost) -> None:
        self._host = host
        self._outbox = Outbox()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._pending: set[str] = set()  # started, and no done / error taken yet
        self._started = False
        self._closed = False

    async def start(self, requests: Sequence[router_pb2.NewRequest]) -> None:
        """Starts `requests` (once). Raises INTERNAL for request ids that repeat, as the
        router stream would end on them."""
        if self._closed or self._started:
            raise RuntimeError("a stream starts its requests once, before close")
        self._started = True
        ids = [request.request_id for request in requests]
        if len(set(ids)) != len(ids) or not all(ids):
            raise aio.AioRpcError(grpc.StatusCode.INTERNAL, aio.Metadata(), aio.Metadata(),
                                  "router request ids must be set and unique")
        loop = asyncio.get_running_loop()
        for request in requests:
            request_id = request.request_id
            self._pending.add(request_id)
            task = loop.create_task(self._host.run(request, self._outbox))
            self._tasks[request_id] = task
            task.add_done_callback(functools.partial(self._on_done, request_id))

    def _on_done(self, request_id: str, task: asyncio.Task[None]) -> None:
        self._tasks.pop(request_id, None)
        if task.cancelled() or self._closed or request_id not in self._pending:
            return
        error = task.exception()
        if error is None:
            return  # it queued its done or error
        logger.error("router request %s failed", request_id, exc_info=error)
        # Its caller must not wait for a last event that will not come (`batches` drops
        # this one if the request's own done was queued before it failed).
        put_error(self._outbox, request_id, _InternalError("internal router error"))

    async def batches(self) -> AsyncIterator[list[router_pb2.GenerateResponse]]:
        """Every event queued since the last batch (waiting for one), until each started
        request has sent `done` or `error`, or the stream is closed."""
        pending = self._pending
        while pending:
            batch = await self._outbox.take()
            if batch is None or self._closed:
                return
            events: list[router_pb2.GenerateResponse] = []
            for event in batch.responses:
                if event.request_id not in pending:
                    continue  # _on_done's error behind the request's own last event
                if event.WhichOneof("event") in _LAST_EVENTS:
                    pending.discard(event.request_id)
                events.append(event)
            if events:
                yield events

    @property
    def is_finished(self) -> bool:
        """Every started request has sent `done` or `error` (or the stream was closed)."""
        return self._started and not self._pending

    def close(self) -> None:
        """Cancels the unfinished requests (the router aborts their engines' work, as for a
        `cancel` on the router stream) and ends `batches`."""
        if self._closed:
            return
        self._closed = True
        for request_id, task in list(self._tasks.items()):
            if request_id in self._pending:
                task.cancel()
        self._pending.clear()
        self._outbox.close()

    async def __aenter__(self) -> InProcessStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()


class InProcessRouter:
    """A `Router` on this event loop, behind the calls a gateway makes of a router."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.address = "in-process"
        self.metrics_registry = router.metrics.registry  # on the caller's /metrics
        self._host = RequestHost(router)
        self._metrics: MetricsServer | None = None

    async def start(self) -> None:
        """Starts the router (engine health checks, engine streams) and, when its settings
        give a `metrics_port`, its Prometheus /metrics there, as a router process does."""
        await self.router.start()
        self._metrics = serve_router_metrics(self.router, self.router.settings.host)

    def open_stream(self) -> InProcessStream:
        return InProcessStream(self._host)

    async def list_models(self, timeout_s: float = 5.0) -> router_pb2.ListModelsResponse:
        del timeout_s  # answered here
        return list_models(self.router)

    async def is_serving(self, timeout_s: float) -> bool:
        """What the router's grpc.health.v1 says: a healthy engine of every role its
        pattern needs."""
        del timeout_s
        return can_serve(self.router)

    async def close(self) -> None:
        await self.router.stop()
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None
