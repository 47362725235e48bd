"""The handler template every generation endpoint follows: validate -> convert -> stream or
complete, with admission, cancellation on disconnect and SSE error reporting in one place."""

from __future__ import annotations

import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from grpc import aio
from pydantic import BaseModel

from gateway.admission import AdmissionLimit
from gateway.errors import GatewayError, from_rpc_error
from gateway.metrics import GatewayMetrics
from gateway.protocol.base import SamplingFields, Usage, dump
from gateway.router_client import RouterLink, RouterStream
from gateway.serving.disconnect import (
    ClientDisconnected,
    FinalChunk,
    RelayResponse,
    run_until_disconnect,
)
from gateway.serving.events import Event, UsageTotals, relay
from gateway.sse import DONE_EVENT, encode_event
from gateway.tenancy import bearer_key, cache_salt
from microserving import tracing
from microserving.v1 import router_pb2

logger = logging.getLogger(__name__)

RequestT = TypeVar("RequestT", bound=SamplingFields)
# Batches of events (what arrived since the handler last looked), then the usage totals.
RouterEvents = AsyncIterator[list[Event] | UsageTotals]

# Status logged for requests whose client left (nginx's convention; never seen by a client).
CLIENT_CLOSED_STATUS = 499


@dataclass(frozen=True)
class ServingContext:
    router: RouterLink
    metrics: GatewayMetrics
    admission: AdmissionLimit
    served_model_name: str
    on_error: Callable[[GatewayError], None]
    is_keyed: bool = False  # API keys are checked: each key is a prefix-cache tenant


def usage_model(totals: UsageTotals) -> Usage:
    details = {"cached_tokens": totals.cached_tokens} if totals.cached_tokens else None
    return Usage(prompt_tokens=totals.prompt_tokens, completion_tokens=totals.completion_tokens,
                 total_tokens=totals.prompt_tokens + totals.completion_tokens,
                 prompt_tokens_details=details)


async def _prepend(first: list[Event] | UsageTotals, rest: RouterEvents) -> RouterEvents:
    yield first
    async for event in rest:
        yield event


class Once:
    """Runs a cleanup exactly once (it is reachable from both the handler and the response)."""

    def __init__(self, *callbacks: Callable[[], None]) -> None:
        self._callbacks: Sequence[Callable[[], None]] | None = callbacks

    def __call__(self) -> None:
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            callback()


class GenerationServing(ABC, Generic[RequestT]):
    id_prefix = "cmpl"

    def __init__(self, context: ServingContext) -> None:
        self.context = context

    @abstractmethod
    def convert(self, request: RequestT, base_id: str) -> list[router_pb2.NewRequest]:
        """Validated request -> router requests (raises GatewayError for invalid input)."""

    @abstractmethod
    async def complete(self, request: RequestT, response_id: str,
                       events: RouterEvents) -> BaseModel:
        """The whole response of a non-streaming request."""

    @abstractmethod
    def stream(self, request: RequestT, response_id: str,
               events: RouterEvents) -> AsyncIterator[bytes]:
        """The SSE events of a streaming request, usage chunk included when asked for: one
        bytes object per batch of router events (one write to the client)."""

    def _cache_salt(self, request: RequestT, http_request: Request) -> str:
        api_key = bearer_key(http_request.headers.get("authorization")) if self.context.is_keyed else None
        return cache_salt(api_key, request.cache_salt)

    def model_name(self, request: RequestT) -> str:
        return request.model or self.context.served_model_name

    async def handle(self, request: RequestT, http_request: Request) -> Response:
        response_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        router_requests = self.convert(request, response_id)
        salt = self._cache_salt(request, http_request)
        for router_request in router_requests:
            router_request.sampling.cache_salt = salt
        started_s = time.perf_counter()
        span = self._trace(http_request, response_id, router_requests)
        num_choices = sum(r.sampling.n or 1 for r in router_requests)
        try:
            units = self.context.admission.acquire(num_choices)
        except BaseException as error:
            span.end(error)
            raise
        self.context.metrics.inflight.inc()
        stream = self.context.router.open_stream()
        cleanup = Once(stream.close, lambda: self.context.admission.release(units),
                       self.context.metrics.inflight.dec, span.end)
        events = relay(stream, router_requests, request.n, self.context.metrics, started_s)
        try:
            if request.stream:
                return await self._start_stream(request, response_id, events, cleanup,
                                                http_request, stream)
            work = self.complete(request, response_id, events)
            result = await run_until_disconnect(http_request, work)
            return JSONResponse(dump(result))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except aio.AioRpcError as error:
            raise from_rpc_error(error) from None
        finally:
            if not request.stream:
                cleanup()

    def _trace(self, http_request: Request, response_id: str,
               router_requests: list[router_pb2.NewRequest]) -> tracing.Span:
        """The request's hop in its trace (from the client's traceparent header, else a new
        trace); each router request carries it on. The id mapping is logged once."""
        parent = tracing.valid_traceparent(http_request.headers.get(tracing.TRACEPARENT_KEY))
        if not parent and not tracing.is_enabled():
            parent = tracing.new_traceparent()  # one trace id for every service's log lines
        client_id = getattr(http_request.state, "request_id", "")
        span = tracing.Span(f"gateway {http_request.scope['path']}", parent, {
            "microserving.request_id": client_id, "microserving.response_id": response_id}).start()
        for router_request in router_requests:
            router_request.traceparent = span.traceparent
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request %s (%s): router request ids %s", client_id, response_id,
                         [r.request_id for r in router_requests])
        return span

    async def _start_stream(self, request: RequestT, response_id: str, events: RouterEvents,
                            cleanup: Once, http_request: Request,
                            stream: RouterStream) -> Response:
        """Waits for the first router event so that early errors keep their HTTP status."""
        try:
            first = await run_until_disconnect(http_request, anext(events))
        except BaseException:
            cleanup()
            raise
        chunks = self.stream(request, response_id, _prepend(first, events))
        return RelayResponse(self._sse(chunks, stream), on_close=cleanup,
                             media_type="text/event-stream")

    async def _sse(self, chunks: AsyncIterator[bytes], stream: RouterStream) -> AsyncIterator[bytes]:
        """Each chunk as it is made, until the router stream has finished: what is left then
        (the last events, the usage chunk, an error) comes without waiting and goes out with
        `[DONE]` and the body's end, in one write."""
        tail = b""
        try:
            async for chunk in chunks:
                if stream.is_finished:
                    tail += chunk
                else:
                    yield chunk
        except GatewayError as error:
            self.context.on_error(error)
            tail += encode_event(error.body())
        except aio.AioRpcError as rpc_error:
            mapped = from_rpc_error(rpc_error)
            self.context.on_error(mapped)
            tail += encode_event(mapped.body())
        yield FinalChunk(tail + DONE_EVENT)
