"""The gateway's only link to the router: one long-lived gRPC channel, and on it one
long-lived `Router.Generate` call shared by every HTTP request (a multiplexer).

Why share the call: a new gRPC bidi call costs the router ~0.8-1 ms before it even sees the
request (call setup and the first message, through grpc.aio's poller), while a request written
on an already-open `Router.Generate` stream reaches it in ~0.2 ms. The router protocol carries
any number of requests per stream, each tagged by its `request_id` and each cancellable with a
`GenerateRequest{cancel}` message, so the gateway keeps one call open and multiplexes on it.

The design (`_SharedCall`, owned by `RouterClient`, opened lazily by the first request):

* One reader task reads the call and hands each `GenerateResponse` to the queue of the HTTP
  request that owns its `request_id` (an unbounded asyncio.Queue per HTTP request: the reader
  never waits for a consumer, so a slow HTTP client cannot hold up the others; each request is
  bounded by its max_tokens). Events of ids nobody owns any more (closed handles) are dropped.
* Writes (NewRequest and cancel) go through one asyncio.Lock: grpc.aio allows one write in
  flight per call (concurrent writes fail with GRPC_CALL_ERROR_TOO_MANY_OPERATIONS). Each write
  runs in a task of its own, shielded from the HTTP request's task, because cancelling an
  awaited `call.write` cancels the whole call, i.e. every request on it.
* `GenerateStream` is one HTTP request's handle. `close()` while some of its router requests
  are still open sends a `cancel` for each (the router aborts the engines' work) and drops its
  queue; it never cancels the shared call and never half-closes it. A request whose `done` or
  `error` arrived needs no cancel.
* When the call breaks (router killed or restarting: a read raises or returns EOF, or a write
  fails), every request open on it gets the failure it would get on a call of its own (the
  read's AioRpcError; UNAVAILABLE "router closed the stream early" on EOF; a write failing with
  INTERNAL - grpc core's "Internal error from Core" - as UNAVAILABLE "the router connection
  broke"), and the next request opens a fresh call. The channel reconnects by itself when the
  router restarts (short reconnect backoff below).
* Request ids must be unique among the active requests of a stream (the router ends the whole
  stream on a duplicate). The gateway's ids are `<kind>-<uuid4 hex>-<prompt index>`; a duplicate
  of an id still active here fails only the request that brings it (INTERNAL), before any write.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeAlias

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

# What a request's queue carries: the router's events, or the failure that ends them all.
Item: TypeAlias = "router_pb2.GenerateResponse | aio.AioRpcError"
_LAST_EVENTS = ("done", "error")


def _unavailable(details: str) -> aio.AioRpcError:
    return aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, aio.Metadata(), aio.Metadata(), details)


def _copy(error: aio.AioRpcError) -> aio.AioRpcError:
    """A fresh exception per request (one object raised in many tasks mixes their tracebacks)."""
    return aio.AioRpcError(error.code(), error.initial_metadata(), error.trailing_metadata(),
                           error.details(), error.debug_error_string())


class _SharedCall:
    """One long-lived Router.Generate call: a reader task dispatching by request_id, and
    serialized, shielded writes."""

    def __init__(self, call: aio.StreamStreamCall) -> None:
        self.call = call
        self.routes: dict[str, asyncio.Queue[Item]] = {}  # open request id -> owner's queue
        self.broken: aio.AioRpcError | None = None
        self._write_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def is_usable(self) -> bool:
        return self.broken is None and not self.call.done()

    async def _read(self) -> None:
        try:
            while True:
                event = await self.call.read()
                if event is aio.EOF:
                    self.fail(_unavailable("router closed the stream early"))
                    return
                assert isinstance(event, router_pb2.GenerateResponse)
                request_id = event.request_id
                queue = self.routes.get(request_id)
                if queue is None:
                    continue  # its handle closed (or cancelled it): nobody wants it
                if event.WhichOneof("event") in _LAST_EVENTS:
                    del self.routes[request_id]
                queue.put_nowait(event)
        except aio.AioRpcError as error:
            self.fail(error)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the call is unusable; never leave requests hanging
            logger.exception("router stream reader failed")
            self.fail(_unavailable("the router connection broke"))

    def fail(self, error: aio.AioRpcError) -> None:
        """Ends the call: every request open on it gets `error`; the next request opens anew."""
        if self.broken is not None:
            return
        self.broken = error
        if self.routes:
            logger.warning("router stream broke (%s) with %d requests open", error.code().name,
                           len(self.routes))
        for queue in self.routes.values():
            queue.put_nowait(_copy(error))
        self.routes.clear()
        self.call.cancel()
        # Writes still queued or in flight on the dead call end now (one can wait forever for
        # initial metadata that a cancelled call never sends, holding the lock: seen when the
        # router was killed under load); their callers get `error` (see `write`).
        current = asyncio.current_task()
        for task in (self._reader, *self._background):
            if task is not current:
                task.cancel()

    async def _locked_write(self, message: router_pb2.GenerateRequest) -> None:
        async with self._write_lock:
            if self.broken is not None:
                raise _copy(self.broken)
            try:
                await self.call.write(message)
            except aio.AioRpcError as error:
                # The router reports request errors in-band, so a write that fails with
                # INTERNAL is grpc core's "Internal error from Core": the connection broke
                # (router killed or restarting) and the client should retry: UNAVAILABLE.
                mapped = error if error.code() is not grpc.StatusCode.INTERNAL else \
                    _unavailable("the router connection broke")
                self.fail(mapped)
                raise _copy(mapped) from None
            except asyncio.InvalidStateError:  # the router ended the call (OK) under the write
                self.fail(_unavailable("router closed the stream early"))
                raise _copy(self.broken or _unavailable("")) from None

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def write(self, message: router_pb2.GenerateRequest) -> None:
        """Writes `message`; cancelling the caller does not cancel the write (nor the call)."""
        task = self._spawn(self._locked_write(message))
        await asyncio.wait({task})  # unlike awaiting the task, leaves it running if we are cancelled
        if task.cancelled():  # `fail` stopped it, or grpc reports the cancelled call so
            raise _copy(self.broken or _unavailable("the router connection broke"))
        task.result()

    def send_cancel(self, request_id: str) -> None:
        """Fire and forget: a failed cancel write means the call broke, which `fail` handled."""
        message = router_pb2.GenerateRequest(cancel=router_pb2.CancelRequest(request_id=request_id))
        task = self._spawn(self._locked_write(message))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieve, no log

    async def close(self) -> None:
        self.fail(aio.AioRpcError(grpc.StatusCode.CANCELLED, aio.Metadata(), aio.Metadata(),
                                  "the gateway is shutting down"))
        tasks = [self._reader, *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class GenerateStream:
    """One HTTP request's router requests on the shared call: start them, read their events,
    cancel the unfinished ones on close."""

    def __init__(self, client: RouterClient) -> None:
        self._client = client
        self._shared: _SharedCall | None = None
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._ids: list[str] = []  # started on the shared call (written or being written)
        self._pending: set[str] = set()  # started, and no done / error read yet
        self._closed = False

    async def start(self, requests: Sequence[router_pb2.NewRequest]) -> None:
        ids = [request.request_id for request in requests]
        if self._closed or self._shared is not None:
            raise RuntimeError("a GenerateStream starts its requests once, before close")
        shared = self._shared = self._client.shared_call()
        duplicates = sorted({i for i in ids if ids.count(i) > 1 or i in shared.routes})
        if duplicates:  # would end the shared stream (and every request on it) at the router
            logger.error("request ids %s are already active on the router stream", duplicates)
            raise aio.AioRpcError(grpc.StatusCode.INTERNAL, aio.Metadata(), aio.Metadata(),
                                  "duplicate router request id")
        for request in requests:
            if shared.broken is not None:
                raise _copy(shared.broken)
            shared.routes[request.request_id] = self._queue
            self._ids.append(request.request_id)
            self._pending.add(request.request_id)
            await shared.write(router_pb2.GenerateRequest(generate=request))

    async def events(self) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Every event until each started request has sent `done` or `error`."""
        while self._pending:
            item = await self._queue.get()
            if isinstance(item, aio.AioRpcError):
                self._pending.clear()
                raise item
            if item.WhichOneof("event") in _LAST_EVENTS:
                self._pending.discard(item.request_id)
            yield item

    def close(self) -> None:
        """Cancels this request's unfinished router requests (client gone, error, shutdown)
        and stops delivering their events; the shared call stays open."""
        if self._closed:
            return
        self._closed = True
        shared = self._shared
        if shared is None:
            return
        open_ids = [i for i in self._ids if shared.routes.get(i) is self._queue]
        for request_id in open_ids:
            del shared.routes[request_id]
        if open_ids and shared.is_usable():
            logger.debug("cancelling router requests %s", open_ids)
            for request_id in open_ids:
                shared.send_cancel(request_id)
        self._pending.clear()
        self._queue = asyncio.Queue()  # drop whatever was delivered and not read

    async def __aenter__(self) -> GenerateStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()


class RouterClient:
    def __init__(self, address: str, transport: TransportSettings, max_calls: int = 16,
                 requests_per_call: int = 16) -> None:
        self.address = address
        self._channel = create_channel(address, transport, _CHANNEL_OPTIONS)
        self._router = router_pb2_grpc.RouterStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        # A few shared calls, each request on the least busy: one call carries every token of
        # its requests through one writer at the router and one reader here.
        self._pool: list[_SharedCall] = []
        self._max_calls = max(1, max_calls)
        self._requests_per_call = max(1, requests_per_call)
        self.num_generate_calls = 0  # Router.Generate calls opened so far

    def open_stream(self) -> GenerateStream:
        return GenerateStream(self)

    def shared_call(self) -> _SharedCall:
        """The least busy open shared Router.Generate call. A call is opened when there is
        none, when one broke (in its place), or when every open call already carries
        `requests_per_call` requests and the pool has room: one call carries every token of
        its requests through one writer at the router and one reader here, so heavy
        concurrency is spread over several."""
        pool = self._pool
        for index, shared in enumerate(pool):
            if not shared.is_usable():
                shared.fail(_unavailable("the router connection broke"))  # no-op if it knew
                pool[index] = self._open_call()
                return pool[index]
        best = min(pool, key=lambda shared: len(shared.routes), default=None)
        if best is None or (len(best.routes) >= self._requests_per_call and len(pool) < self._max_calls):
            best = self._open_call()
            pool.append(best)
        return best

    def _open_call(self) -> _SharedCall:
        self.num_generate_calls += 1
        return _SharedCall(self._router.Generate())

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
        pool, self._pool = self._pool, []
        for shared in pool:
            await shared.close()
        await self._channel.close()
