"""The engines as the router calls them: the registry (endpoints, health), one multiplexed
Generate stream per engine, the Abort fan-out, and what a failed call means (the error the
runner handles; an engine at fault leaves rotation)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc

from microserving.multiplex import MultiplexedCall, Sink
from microserving.transport import FAULT_METADATA_KEY, status_code
from microserving.v1 import engine_pb2, router_pb2
from router.attempt import Attempt
from router.discovery import parse_engine_spec
from router.endpoint import Endpoint
from router.errors import EngineCallError, InvalidRequestError
from router.metrics import RouterMetrics
from router.registry import EngineRegistry
from router.settings import RouterSettings

logger = logging.getLogger(__name__)

GenerateCall = MultiplexedCall[engine_pb2.EngineGenerateResponse, engine_pb2.GenerateOutput]


class EngineStream:
    """One engine's multiplexed Generate stream, shared by every request the router decodes
    there (a `microserving.multiplex.MultiplexedCall`, opened on first use and replaced when
    it breaks). Its reader hands each request's output straight to that request's sink."""

    def __init__(self, endpoint: Endpoint, batches: bool = True) -> None:
        self.endpoint = endpoint
        self._batches = batches  # RouterSettings.engine_stream_batches
        self._call: GenerateCall | None = None
        # False once the engine answered UNIMPLEMENTED (a shim from before Engine.Generate):
        # its requests then go through StartGenerate.
        self.is_supported = True

    @property
    def current_call(self) -> GenerateCall | None:
        return self._call

    def _current(self) -> GenerateCall:
        call = self._call
        if call is None or not call.is_usable():
            # Actions queued behind a write in flight go out together where the engine says it
            # takes them so (a wave of starts and calls: one message, not one each).
            status = self.endpoint.status
            takes = self._batches and status is not None and status.takes_batched_actions
            batch = batched_actions if takes else None
            call = self._call = MultiplexedCall(
                self.endpoint.stub.Generate(), _outputs_of, _request_id_of, on_broken=self._on_broken,
                batch=batch)
        return call

    def _on_broken(self, error: grpc.aio.AioRpcError) -> None:
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.is_supported = False
            logger.warning("engine %s does not serve Engine.Generate; using StartGenerate",
                           self.endpoint.address)

    async def start(self, request: engine_pb2.StartGenerateRequest, sink: Sink[engine_pb2.GenerateOutput]) -> None:
        """Send `start`; from now on `sink` gets the request's output. Raises
        grpc.aio.AioRpcError when the stream cannot take it (it is then dropped). Cancelling
        the caller does not cancel the write (see MultiplexedCall.write)."""
        message = engine_pb2.EngineGenerateRequest(start=request)
        await self._current().start(request.request_id, message, sink)

    def takes_calls(self, request_id: str) -> bool:
        """Whether a PrepRecv or RemoteSend for `request_id` can go on this stream: the engine
        says it serves them there (its last status) and the id is not open on the stream."""
        status = self.endpoint.status
        if not self.is_supported or status is None or not status.serves_stream_calls:
            return False
        call = self._call
        return call is None or request_id not in call.routes

    async def call(self, request_id: str, message: engine_pb2.EngineGenerateRequest,
                   timeout_s: float | None,
                   on_first: Callable[[engine_pb2.GenerateOutput], None] | None = None) -> engine_pb2.GenerateOutput:
        """A PrepRecv or RemoteSend made on the stream: its one output, or the
        grpc.aio.AioRpcError the unary call would have raised (the engine's error with its
        fault as trailing metadata, DEADLINE_EXCEEDED after `timeout_s`, the stream's failure).
        Cancelling the caller or the deadline cancels the call on the engine. `on_first`: gets
        the output with a RemoteSend's first tokens (sample_first_token) as it comes, in the
        stream's reader."""
        reply = _Reply(on_first)
        call = self._current()
        try:
            async with asyncio.timeout(timeout_s):
                await call.start(request_id, message, reply)
                output = await reply.future
        except TimeoutError:
            self._cancel_call(call, request_id)
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "Deadline Exceeded") from None
        except asyncio.CancelledError:
            self._cancel_call(call, request_id)
            raise
        if output.HasField("error"):
            error = output.error
            trailing = grpc.aio.Metadata((FAULT_METADATA_KEY, error.fault)) if error.fault else \
                grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(status_code(error.code), grpc.aio.Metadata(), trailing,
                                       error.message)
        return output

    def _cancel_call(self, call: GenerateCall, request_id: str) -> None:
        """A call given up before its answer: `cancel` goes after its message (which is
        written even when its caller was cancelled while it queued), and the engine undoes the
        call or, if it ended, aborts the request. No answer is routed."""
        call.routes.pop(request_id, None)
        if call.is_usable():
            call.write_nowait(_cancel_message(request_id))

    def send_to(self, target: engine_pb2.RemoteSendTarget) -> None:
        """The receiver of a RemoteSend made on this stream with kv_addr_follows, written
        after it on the same stream; no answer of its own (the send's ends both). Dropped
        when the send is no longer open here: its caller has its outcome."""
        call = self._call
        if call is not None and target.request_id in call.routes:
            call.write_nowait(engine_pb2.EngineGenerateRequest(send_to=target))

    def cancel(self, request_id: str) -> None:
        """Abort a request that has not ended (no-op otherwise); its output is dropped."""
        if self._call is not None:
            self._call.cancel(request_id, _cancel_message(request_id))

    def abort_unstarted(self, request_id: str) -> None:
        """Abort what `request_id` holds on the engine though nothing of it runs on this
        stream (a PrepRecv reservation no start will take): a `cancel` for an id the stream
        does not know aborts it on the engine, a message instead of an Abort call."""
        if self._call is not None:
            self._cancel_call(self._call, request_id)

    async def close(self) -> None:
        if self._call is not None:
            await self._call.close()


def _cancel_message(request_id: str) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(cancel=engine_pb2.GenerateCancel(request_id=request_id))


class _Reply:
    """The sink of a call made on an engine stream: its one output (a RemoteSend's first
    tokens, an output before it, go to `on_first`), or the stream's failure."""

    def __init__(self, on_first: Callable[[engine_pb2.GenerateOutput], None] | None = None) -> None:
        self.future: asyncio.Future[engine_pb2.GenerateOutput] = \
            asyncio.get_running_loop().create_future()
        self._on_first = on_first

    def deliver(self, output: engine_pb2.GenerateOutput) -> bool:
        if self.future.done():
            return True
        if output.continuations and self._on_first is not None:
            self._on_first(output)
            if not (output.HasField("remote_send") or output.HasField("error")):
                return False  # the call's result is still to come
        self.future.set_result(output)
        return True

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


def batched_actions(actions: list[engine_pb2.EngineGenerateRequest]) -> engine_pb2.EngineGenerateRequest:
    """Engine.Generate actions as one message (EngineGenerateRequest.batch), in order."""
    return engine_pb2.EngineGenerateRequest(batch=engine_pb2.EngineGenerateActions(actions=actions))


def _outputs_of(message: engine_pb2.EngineGenerateResponse) -> Sequence[engine_pb2.GenerateOutput]:
    return message.outputs  # type: ignore[return-value]


def _request_id_of(output: engine_pb2.GenerateOutput) -> str:
    return output.request_id


def _strip_scheme(server_url: str) -> str:
    for scheme in ("http://", "https://"):
        if server_url.startswith(scheme):
            return server_url[len(scheme):].rstrip("/")
    return server_url


class Engines:
    def __init__(self, settings: RouterSettings, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.registry = EngineRegistry(
            settings.transport,
            health_interval_s=settings.health_interval_s,
            health_timeout_s=settings.health_timeout_s,
        )
        for i, spec in enumerate(settings.engines):
            parsed = parse_engine_spec(spec)
            gpus = settings.engine_num_gpus[i] if i < len(settings.engine_num_gpus) else 1
            self.registry.add(parsed.address, parsed.roles, num_gpus=gpus)
        self.registry.add_listener(self._on_health_change)
        self._streams: dict[str, EngineStream] = {}
        self._detached_aborts: set[asyncio.Task[None]] = set()  # kept referenced until they end

    async def stop(self) -> None:
        await asyncio.gather(*(s.close() for s in self._streams.values()))
        self._streams.clear()
        await self.registry.stop()

    def _on_health_change(self, endpoint: Endpoint, previous: int) -> None:
        if previous == router_pb2.ENGINE_HEALTH_SERVING and not endpoint.is_available:
            self.metrics.failovers.labels(engine=endpoint.address).inc()

    def endpoint(self, server_url: str) -> Endpoint:
        """A registered engine. Nothing else is ever dialled: the router's calls carry the
        shared token, and an address from a request (MigrateContext.source, a custom
        router's server_url) must not receive it."""
        address = _strip_scheme(server_url)
        endpoint = self.registry.get(address)
        if endpoint is None:
            raise InvalidRequestError(f"{address!r} is not an engine registered with this router",
                                      param="engine")
        return endpoint

    def device_id_starts(self) -> list[int]:
        """MLC's first device id of each engine: its GPUs follow the ones before it."""
        starts, total = [], 0
        for endpoint in self.registry.endpoints:
            starts.append(total)
            total += endpoint.num_gpus
        return starts

    def device_id_start(self, address: str) -> int:
        addresses = [e.address for e in self.registry.endpoints]
        return self.device_id_starts()[addresses.index(address)] if address in addresses else 0

    def stream(self, endpoint: Endpoint) -> EngineStream:
        """The engine's multiplexed Generate stream (the object lives as long as the router;
        its call is opened on first use and again after it breaks)."""
        stream = self._streams.get(endpoint.address)
        if stream is None or stream.endpoint is not endpoint:
            stream = self._streams[endpoint.address] = EngineStream(
                endpoint, batches=self.settings.engine_stream_batches)
        return stream

    def call_failed(self, exc: grpc.aio.AioRpcError | TimeoutError, address: str, stage: str) -> EngineCallError:
        if isinstance(exc, grpc.aio.AioRpcError):
            return self.call_failed_with(exc.code(), exc.details() or "", address, stage)
        return self.call_failed_with(grpc.StatusCode.DEADLINE_EXCEEDED, "stage deadline passed", address, stage)

    def call_failed_with(self, code: grpc.StatusCode, detail: str, address: str, stage: str) -> EngineCallError:
        """An engine call (or one request on an engine stream) failed with `code`: the error
        the runner handles; an engine at fault leaves rotation."""
        error = EngineCallError(f"{stage} on {address} failed: {code.name}", code=code, address=address, stage=stage,
                                detail=detail)
        self.metrics.engine_call_failures.labels(engine=address, call=stage, code=code.name).inc()
        if error.is_engine_fault:
            self.registry.mark_failed(address)
        logger.info("%s on %s failed: %s %s", stage, address, code.name, detail)
        return error

    async def abort(self, engine_request_id: str, addresses: Sequence[str]) -> None:
        """Abort the request on each engine (frees reservations and KV there)."""
        request = engine_pb2.AbortRequest(request_id=engine_request_id)

        async def abort_one(address: str) -> None:
            endpoint = self.registry.get(address)
            if endpoint is None:
                return  # it left the registry meanwhile
            try:
                await endpoint.stub.Abort(request, timeout=self.settings.abort_timeout_s)
            except grpc.aio.AioRpcError as exc:
                logger.info("abort of %s on %s failed: %s", engine_request_id, address, exc.code())

        await asyncio.gather(*(abort_one(a) for a in addresses))

    async def abort_touched(self, attempt: Attempt) -> None:
        await self.abort(attempt.engine_request_id, list(attempt.touched))

    async def abort_attempt(self, attempt: Attempt, faulty: str | None = None) -> None:
        """Abort on every engine an attempt that did not finish cleanly touched; shielded
        so a second cancel cannot skip the cleanup.

        The Abort to a `faulty` engine (dead or stalled) runs detached: a stalled engine would
        hold the retry for the whole Abort deadline, and it is out of rotation anyway."""
        request_id = attempt.engine_request_id
        rest = [a for a in attempt.touched if a != faulty]
        if faulty is not None and faulty in attempt.touched:
            task = asyncio.get_running_loop().create_task(self.abort(request_id, [faulty]))
            self._detached_aborts.add(task)
            task.add_done_callback(self._detached_aborts.discard)
        if rest:
            await asyncio.shield(self.abort(request_id, rest))
