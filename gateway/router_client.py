"""The gateway's only link to the router: long-lived gRPC channels (one per router replica), and
on them a few long-lived `Router.GenerateBatched` calls shared by every HTTP request.

Why share calls: a new gRPC bidi call costs the router ~0.8-1 ms before it even sees the
request (call setup and the first message, through grpc.aio's poller), while a request written
on an already-open stream reaches it in ~0.2 ms. The router protocol carries any number of
requests per stream, each tagged by its `request_id` and each cancellable with a
`GenerateRequest{cancel}` message. GenerateBatched (rather than Generate) because the router
then sends one message per engine step for all the stream's requests, not one per token.

Each call is a `microserving.multiplex.MultiplexedCall`: one reader task hands every event to
the `GenerateStream` (one HTTP request) that owns its request id, which only appends it to
its inbox (a slow HTTP client holds up nobody; each request is bounded by its max_tokens);
writes are serialized and shielded from the HTTP request's cancellation, since cancelling an
awaited `call.write` cancels the whole call. The HTTP request's task takes everything in its
inbox at once (`batches`), so a stream that lags behind gets fewer, larger SSE chunks.

* `GenerateStream.close()` while some of its router requests are still open sends a `cancel`
  for each (the router aborts the engines' work); it never cancels the shared call. A request
  whose `done` or `error` arrived needs no cancel.
* When a call breaks (router killed or restarting), every request open on it gets the failure
  it would get on a call of its own (the read's AioRpcError; UNAVAILABLE on EOF or when a write
  fails with grpc core's INTERNAL), and the next request opens a fresh call. Channels
  reconnect by themselves when the router restarts (short reconnect backoff below).
* Request ids must be unique among the active requests of a stream (the router ends the whole
  stream on a duplicate). The gateway's ids are `<kind>-<uuid4 hex>-<prompt index>`; a duplicate
  of an id still active here fails only the request that brings it (INTERNAL), before any write.
* Several routers (replicas behind `--router a,b`): a channel each, and a request goes on the
  least busy call of all; a new call opens on the replica with the fewest calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Protocol, TypeAlias, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from microserving.multiplex import MultiplexedCall, unavailable
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
    # A name resolving to several routers (a Kubernetes headless Service) spreads the shared
    # calls over all of them; one address: the same as pick-first.
    ("grpc.lb_policy_name", "round_robin"),
)

T = TypeVar("T")

# What a request's inbox carries: the router's events, or the failure that ends them all.
Item: TypeAlias = "router_pb2.GenerateResponse | aio.AioRpcError"
_LAST_EVENTS = ("done", "error")
RouterCall: TypeAlias = "MultiplexedCall[router_pb2.GenerateBatchedResponse, router_pb2.GenerateResponse]"


def _responses_of(batch: router_pb2.GenerateBatchedResponse) -> Sequence[router_pb2.GenerateResponse]:
    return batch.responses  # type: ignore[return-value]


def _request_id_of(response: router_pb2.GenerateResponse) -> str:
    return response.request_id


class RouterStream(Protocol):
    """One HTTP request's router requests: `GenerateStream` on a shared gRPC call, or a
    stream of a router in this process (router/inprocess.py, `microserving serve`)."""

    async def start(self, requests: Sequence[router_pb2.NewRequest]) -> None: ...

    def batches(self) -> AsyncIterator[list[router_pb2.GenerateResponse]]: ...

    @property
    def is_finished(self) -> bool: ...

    def close(self) -> None: ...

    async def __aenter__(self) -> RouterStream: ...

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None: ...


class RouterLink(Protocol):
    """What the gateway asks of its router: `RouterClient` over gRPC, or a router run in the
    gateway's own process (router/inprocess.py), handed to `create_app`."""

    address: str

    @property
    def metrics_registry(self) -> CollectorRegistry | None:
        """The router's Prometheus metrics, to serve on the gateway's /metrics (a router in
        this process); None for a router of its own, which serves them itself."""

    async def start(self) -> None: ...

    def open_stream(self) -> RouterStream: ...

    async def list_models(self, timeout_s: float = 5.0) -> router_pb2.ListModelsResponse: ...

    async def is_serving(self, timeout_s: float) -> bool: ...

    async def close(self) -> None: ...


class GenerateStream:
    """One HTTP request's router requests on a shared call: start them, read their events,
    cancel the unfinished ones on close. The call's reader delivers into its inbox."""

    def __init__(self, client: RouterClient) -> None:
        self._client = client
        self._call: RouterCall | None = None
        self._inbox: list[Item] = []
        self._waiter: asyncio.Future[None] | None = None
        self._ids: list[str] = []  # started on the shared call (written or being written)
        self._pending: set[str] = set()  # started, and no done / error read yet
        self._closed = False

    # ---- the call's side (multiplex.Sink) ----
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def deliver(self, response: router_pb2.GenerateResponse) -> bool:
        self._inbox.append(response)
        self._wake()
        return response.WhichOneof("event") in _LAST_EVENTS

    def fail(self, error: aio.AioRpcError) -> None:
        self._inbox.append(error)
        self._wake()

    # ---- the HTTP request's side ----
    async def start(self, requests: Sequence[router_pb2.NewRequest]) -> None:
        ids = [request.request_id for request in requests]
        if self._closed or self._call is not None:
            raise RuntimeError("a GenerateStream starts its requests once, before close")
        call = self._call = self._client.shared_call()
        duplicates = sorted({i for i in ids if ids.count(i) > 1 or i in call.routes})
        if duplicates:  # would end the shared stream (and every request on it) at the router
            logger.error("request ids %s are already active on the router stream", duplicates)
            raise aio.AioRpcError(grpc.StatusCode.INTERNAL, aio.Metadata(), aio.Metadata(),
                                  "duplicate router request id")
        for request in requests:
            self._ids.append(request.request_id)
            self._pending.add(request.request_id)
            await call.start(request.request_id, router_pb2.GenerateBatchedRequest(generate=request), self)

    async def batches(self) -> AsyncIterator[list[router_pb2.GenerateResponse]]:
        """Every event that arrived since the last batch (waiting for one), until each
        started request has sent `done` or `error`, or the stream is closed."""
        while self._pending:
            while not self._inbox:
                if self._closed:
                    return
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            items, self._inbox = self._inbox, []
            batch: list[router_pb2.GenerateResponse] = []
            for item in items:
                if isinstance(item, aio.AioRpcError):
                    self._pending.clear()
                    raise item
                if item.WhichOneof("event") in _LAST_EVENTS:
                    self._pending.discard(item.request_id)
                batch.append(item)
            yield batch

    @property
    def is_finished(self) -> bool:
        """Every started request has sent `done` or `error` (or the stream was closed): what
        its reader still yields comes without waiting."""
        return self._call is not None and not self._pending

    async def events(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        """`batches`, one event at a time."""
        async for batch in self.batches():
            for event in batch:
                yield event

    def close(self) -> None:
        """Cancels this request's unfinished router requests (client gone, error, shutdown)
        and stops delivering their events; the shared call stays open."""
        if self._closed:
            return
        self._closed = True
        call = self._call
        if call is not None:
            for request_id in self._ids:
                if call.routes.get(request_id) is self:
                    cancel = router_pb2.CancelRequest(request_id=request_id)
                    call.cancel(request_id, router_pb2.GenerateBatchedRequest(cancel=cancel))
        self._pending.clear()
        self._inbox = []  # drop whatever was delivered and not read
        self._wake()  # a reader waiting for events ends

    async def __aenter__(self) -> GenerateStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()


class _Replica:
    """One router process: its channel, stubs and the shared calls open on it."""

    def __init__(self, address: str, transport: TransportSettings) -> None:
        self.address = address
        # A channel of its own per replica (no subchannel shared with another channel to the
        # same address), so replicas behind one address each get a connection.
        options = (*_CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1))
        self.channel = create_channel(address, transport, options)
        self.router = router_pb2_grpc.RouterStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.num_calls = 0  # open calls on this replica


class RouterClient:
    def __init__(self, address: str, transport: TransportSettings, max_calls: int = 16,
                 requests_per_call: int = 16) -> None:
        """`address`: one router "host:port", or several separated by commas (replicas)."""
        self.address = address
        addresses = [a.strip() for a in address.split(",") if a.strip()]
        if not addresses:
            raise ValueError("no router address given")
        self._replicas = [_Replica(a, transport) for a in addresses]
        # A few shared calls, each request on the least busy: one call carries every token of
        # its requests through one writer at the router and one reader here.
        self._pool: list[tuple[_Replica, RouterCall]] = []
        self._max_calls = max(len(self._replicas), max_calls)
        self._requests_per_call = max(1, requests_per_call)
        self.num_generate_calls = 0  # Router.GenerateBatched calls opened so far
        self.metrics_registry: CollectorRegistry | None = None  # the router serves its own

    async def start(self) -> None:
        """Nothing to start: the channels connect when first used."""

    def open_stream(self) -> GenerateStream:
        return GenerateStream(self)

    def shared_call(self) -> RouterCall:
        """The least busy open shared call. A call is opened when there is none, when one
        broke (in its place), or when every open call already carries `requests_per_call`
        requests and the pool has room: one call carries every token of its requests through
        one writer at the router and one reader here, so heavy concurrency is spread over
        several (and over every replica)."""
        pool = self._pool
        for index, (replica, call) in enumerate(pool):
            if not call.is_usable():
                call.fail(unavailable("the router connection broke"))  # no-op if it knew
                pool[index] = (replica, self._open_call(replica))
                return pool[index][1]
        best = min(pool, key=lambda entry: len(entry[1].routes), default=None)
        if best is None or (
            len(best[1].routes) >= self._requests_per_call and len(pool) < self._max_calls
        ) or len(pool) < len(self._replicas):
            replica = min(self._replicas, key=lambda r: r.num_calls)
            best = (replica, self._open_call(replica))
            replica.num_calls += 1
            pool.append(best)
        return best[1]

    def _open_call(self, replica: _Replica) -> RouterCall:
        self.num_generate_calls += 1
        return MultiplexedCall(replica.router.GenerateBatched(), _responses_of, _request_id_of)

    async def _first_answer(self, call: Callable[[_Replica], Awaitable[T]]) -> T:
        """The first replica's answer; the next one's when it fails."""
        for replica in self._replicas[:-1]:
            try:
                return await call(replica)
            except aio.AioRpcError as error:
                logger.debug("router %s: %s", replica.address, error.code().name)
        return await call(self._replicas[-1])

    async def list_models(self, timeout_s: float = 5.0) -> router_pb2.ListModelsResponse:
        return await self._first_answer(lambda replica: replica.router.ListModels(
            router_pb2.ListModelsRequest(), timeout=timeout_s))

    async def is_serving(self, timeout_s: float) -> bool:
        """The routers' grpc.health.v1 status: SERVING (any replica) means requests can run."""
        checks = [self._replica_serving(replica, timeout_s) for replica in self._replicas]
        return any(await asyncio.gather(*checks))

    @staticmethod
    async def _replica_serving(replica: _Replica, timeout_s: float) -> bool:
        try:
            reply = await replica.health.Check(health_pb2.HealthCheckRequest(service=""),
                                               timeout=timeout_s)
        except aio.AioRpcError as error:
            logger.debug("router %s health check failed: %s", replica.address, error.code().name)
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        pool, self._pool = self._pool, []
        for _, call in pool:
            await call.close(aio.AioRpcError(grpc.StatusCode.CANCELLED, aio.Metadata(),
                                             aio.Metadata(), "the gateway is shutting down"))
        for replica in self._replicas:
            await replica.channel.close()
