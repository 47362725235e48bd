"""The Router gRPC service: a thin layer that turns wire messages into router calls.

Generate reads the client's stream in a task of its own (start / cancel), runs each request
in a RequestRunner task and writes the shared Outbox back. Router errors are mapped to status
codes once, in `_map_errors`, for the unary RPCs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc import aio

from microserving import tracing
from microserving.pattern_names import PATTERN_BY_NAME
from microserving.v1 import router_pb2, router_pb2_grpc
from router.errors import InvalidRequestError, OverloadedError, RouterError
from router.outbox import Outbox, StreamError
from router.prepared_request import prepare_off_loop
from router.request_runner import RequestRunner
from router.router import Router

logger = logging.getLogger(__name__)

Reply = TypeVar("Reply")
# A client message of Generate or GenerateBatched (the same actions).
ClientMessage = router_pb2.GenerateRequest | router_pb2.GenerateBatchedRequest


def _map_errors(
    method: Callable[[Any, Any, aio.ServicerContext], Awaitable[Reply]],
) -> Callable[[Any, Any, aio.ServicerContext], Awaitable[Reply]]:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: aio.ServicerContext) -> Reply:
        try:
            return await method(self, request, context)
        except RouterError as exc:
            code, message, _ = exc.client_view()
            await context.abort(code, message)
            raise  # abort raises; this line is not reached
        except Exception:
            logger.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal router error")
            raise

    return wrapper


class RequestHost:
    """Runs one router request into an Outbox: the router's own limit on requests in flight,
    its trace span, tokenization off the event loop, then the RequestRunner. Shared by the
    gRPC service and a router run in its caller's process (router/inprocess.py)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.num_inflight = 0

    async def run(self, new: router_pb2.NewRequest, outbox: Outbox) -> None:
        router = self.router
        limit = router.settings.max_inflight
        if limit and self.num_inflight >= limit:
            put_error(outbox, new.request_id, OverloadedError(
                f"the router has {limit} requests in flight, its limit; retry later"))
            return
        arrived_s = time.perf_counter()
        self.num_inflight += 1
        router.metrics.inflight.inc()
        span = tracing.Span("router.request", tracing.valid_traceparent(new.traceparent),
                            {"microserving.request_id": new.request_id}).start()
        try:
            try:
                prepared = await prepare_off_loop(new, router.tokenizer, router.model_id,
                                                  router.registry.max_context_length)
            except RouterError as exc:
                put_error(outbox, new.request_id, exc)
                return
            await RequestRunner(router, prepared, outbox, arrived_s, span).run()
        finally:
            span.end()
            self.num_inflight -= 1
            router.metrics.inflight.dec()


def list_models(router: Router) -> router_pb2.ListModelsResponse:
    model = router_pb2.ModelInfo(
        id=router.model_id, created=router.created, owned_by="microserving",
        max_context_length=router.registry.max_context_length or 0,
    )
    return router_pb2.ListModelsResponse(models=[model])


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router) -> None:
        self._router = router
        self._host = RequestHost(router)

    async def Generate(
        self, request_iterator: AsyncIterator[router_pb2.GenerateRequest], context: aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        async for batch in self._serve(request_iterator, context):
            for response in batch.responses:
                yield response

    async def GenerateBatched(
        self, request_iterator: AsyncIterator[router_pb2.GenerateBatchedRequest],
        context: aio.ServicerContext,
    ) -> AsyncIterator[router_pb2.GenerateBatchedResponse]:
        async for batch in self._serve(request_iterator, context):
            yield batch

    async def _serve(
        self, request_iterator: AsyncIterator[ClientMessage], context: aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateBatchedResponse]:
        """Both Generate RPCs: the client's requests run, their events come out in batches
        (everything queued when the writer is free)."""
        outbox = Outbox()
        runners: dict[str, asyncio.Task[None]] = {}
        reader = asyncio.get_running_loop().create_task(self._read(request_iterator, outbox, runners))
        try:
            while True:
                try:
                    batch = await outbox.take()
                except StreamError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    return
                if batch is None:
                    return
                yield batch
        finally:
            reader.cancel()
            tasks = list(runners.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _read(
        self, request_iterator: AsyncIterator[ClientMessage], outbox: Outbox,
        runners: dict[str, asyncio.Task[None]],
    ) -> None:
        try:
            async for message in request_iterator:
                action = message.WhichOneof("action")
                if action == "generate":
                    self._start(message.generate, outbox, runners)
                elif action == "cancel":
                    task = runners.get(message.cancel.request_id)
                    if task is not None:
                        task.cancel()
                else:
                    raise StreamError("a GenerateRequest must set generate or cancel")
        except StreamError as exc:
            outbox.fail(exc)
            return
        except Exception:  # noqa: BLE001 - e.g. a message that does not deserialize
            # Without this the reader dies silently and the call hangs until its deadline.
            logger.warning("Generate: unreadable request stream", exc_info=True)
            outbox.fail(StreamError("the request stream could not be read (malformed message)"))
            return
        if runners:
            await asyncio.gather(*runners.values(), return_exceptions=True)
        outbox.close()

    def _start(self, new: router_pb2.NewRequest, outbox: Outbox, runners: dict[str, asyncio.Task[None]]) -> None:
        if not new.request_id:
            raise StreamError("generate.request_id must be set")
        if new.request_id in runners:
            raise StreamError(f"request_id {new.request_id!r} is already active on this stream")
        task = asyncio.get_running_loop().create_task(self._host.run(new, outbox))
        runners[new.request_id] = task
        task.add_done_callback(lambda _: runners.pop(new.request_id, None))

    @_map_errors
    async def ListModels(
        self, request: router_pb2.ListModelsRequest, context: aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        return list_models(self._router)

    @_map_errors
    async def GetStatus(
        self, request: router_pb2.RouterGetStatusRequest, context: aio.ServicerContext
    ) -> router_pb2.RouterGetStatusResponse:
        router = self._router
        return router_pb2.RouterGetStatusResponse(
            pattern=PATTERN_BY_NAME[router.router_mode],
            pd_balance_factor=router.pd_balance_factor,
            cache_aware=router.cache_aware,
            engines=[e.to_info() for e in router.registry.endpoints],
            num_inflight_requests=self._host.num_inflight,
        )

    @_map_errors
    async def MigrateContext(
        self, request: router_pb2.MigrateContextRequest, context: aio.ServicerContext
    ) -> router_pb2.MigrateContextResponse:
        if not request.target:
            raise InvalidRequestError("target must be set", param="target")
        matched, moved, source = await self._router.migrate_context(
            list(request.token_ids.ids), request.source, request.target
        )
        return router_pb2.MigrateContextResponse(
            prefix_matched_length=matched, num_tokens_moved=moved, source=source
        )


def put_error(outbox: Outbox, request_id: str, exc: RouterError) -> None:
    error = router_pb2.RequestError(code=exc.code.value[0], message=exc.message, param=exc.param)
    outbox.put(request_id, error=error)
