"""The Engine gRPC servicer: validate -> convert -> call the backend -> convert back. Thin on
purpose; errors are mapped once by `map_errors`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from grpc import aio

from engine_shim import validation
from engine_shim.backend import Backend, SendTarget
from engine_shim.convert import (
    continuations_from_pb,
    generate_output_to_pb,
    sampling_from_pb,
    send_result_to_pb,
    status_to_pb,
)
from engine_shim.engine.api import (
    Continuation,
    GenerateOutput,
    InvalidRequestError,
    OnFirst,
    SamplingParams,
    UnavailableError,
)
from engine_shim.errors import map_errors
from engine_shim.multiplex import GenerateMultiplexer
from engine_shim.requests import RequestTracker
from microserving import tracing
from microserving.v1 import common_pb2, engine_pb2, engine_pb2_grpc


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(
        self, backend: Backend, tracker: RequestTracker, *, role: str, max_prompt_tokens: int,
        stream_interval_s: float = 0.0, stream_updates_per_s: float = 0.0,
    ) -> None:
        self._backend = backend
        self._stream_interval_s = stream_interval_s
        self._stream_updates_per_s = stream_updates_per_s
        self._tracker = tracker
        self.hold_reservation = tracker.hold  # told by the KV data plane (kv_plane/receiver.py)
        self._role = role
        self._max_prompt_tokens = max_prompt_tokens
        self.is_ready = False
        self.is_draining = False

    def _check_serving(self) -> None:
        if self.is_draining:
            raise UnavailableError("engine is draining for shutdown")
        if not self.is_ready:
            raise UnavailableError("engine is still loading")

    def _checked(
        self, request_id: str, token_ids: Sequence[int], sampling_pb: common_pb2.SamplingParams
    ) -> tuple[npt.NDArray[np.integer], SamplingParams]:
        """Checks shared by every call that carries a prompt."""
        self._check_serving()
        info = self._backend.info
        validation.check_request_id(request_id)
        tokens = validation.token_ids(token_ids)
        validation.check_token_ids(tokens, info.vocab_size, self._max_prompt_tokens)
        sampling = sampling_from_pb(sampling_pb)
        validation.check_sampling(sampling, info.vocab_size)
        validation.check_context(len(tokens), sampling, info.max_context_length)
        return tokens, sampling

    @map_errors
    async def PrepRecv(
        self, request: engine_pb2.PrepRecvRequest, context: aio.ServicerContext
    ) -> engine_pb2.PrepRecvResponse:
        return await self.prep_recv(request, tracing.from_metadata(context.invocation_metadata()))

    async def prep_recv(
        self, request: engine_pb2.PrepRecvRequest, traceparent: str
    ) -> engine_pb2.PrepRecvResponse:
        """PrepRecv, as a unary call or on an Engine.Generate stream (GenerateMultiplexer)."""
        tokens, sampling = self._checked(request.request_id, request.token_ids, request.sampling)
        if request.whole_prompt and not self._backend.info.samples_first_token:
            raise InvalidRequestError(
                f"whole_prompt: the {self._backend.info.name} backend cannot continue another engine's choices")
        end = validation.prep_recv_end(request.end, len(tokens), request.whole_prompt)
        self._tracker.begin_prep_recv(request.request_id)
        reserved_end: int | None = None
        try:
            with _span("shim.prep_recv", request.request_id, traceparent):
                reservation = await self._backend.prep_recv(request.request_id, tokens, end, sampling,
                                                            whole_prompt=request.whole_prompt)
            reserved_end = reservation.end
        finally:
            self._tracker.end_prep_recv(request.request_id, reserved_end)
        return engine_pb2.PrepRecvResponse(
            kv_addr_info=reservation.kv_addr_info,
            prefix_matched_length=reservation.prefix_matched_length,
            end=reservation.end,
        )

    @map_errors
    async def RemoteSend(
        self, request: engine_pb2.RemoteSendRequest, context: aio.ServicerContext
    ) -> engine_pb2.RemoteSendResponse:
        return await self.remote_send(request, tracing.from_metadata(context.invocation_metadata()))

    async def remote_send(
        self, request: engine_pb2.RemoteSendRequest, traceparent: str,
        target: Awaitable[engine_pb2.RemoteSendTarget] | None = None, on_first: OnFirst | None = None,
    ) -> engine_pb2.RemoteSendResponse:
        """RemoteSend, as a unary call or on an Engine.Generate stream (GenerateMultiplexer);
        `target`: where the stream's `send_to` for a send made with kv_addr_follows arrives;
        `on_first`: where the first tokens of a send made with sample_first_token go."""
        tokens, sampling = self._checked(request.request_id, request.token_ids, request.sampling)
        begin, end = validation.remote_send_window(request.begin, request.end, len(tokens),
                                                   samples_first=request.sample_first_token)
        later = self._checked_follows(request, target, begin, end) if request.kv_addr_follows else None
        if later is None:
            validation.check_kv_addr_info(request.kv_addr_info)
        first = self._checked_first(on_first) if request.sample_first_token else None
        self._tracker.begin_remote_send(request.request_id)
        try:
            with _span("shim.remote_send", request.request_id, traceparent), \
                    (contextlib.nullcontext() if first is None else
                     self._backend.sampling_first(request.request_id, sampling, first)) as delivery:
                if later is None:
                    result = await self._backend.remote_send(
                        request.request_id, tokens, begin, end, request.kv_addr_info,
                        request.recv_rank, sampling,
                    )
                else:
                    result = await self._backend.remote_send_later(
                        request.request_id, tokens, begin, end, sampling, later)
                if delivery is not None:
                    await delivery.delivered()  # the first tokens go out before the result
        finally:
            self._tracker.end_remote_send(request.request_id)
        return send_result_to_pb(result)

    def _checked_first(self, on_first: OnFirst | None) -> OnFirst:
        if on_first is None:
            raise InvalidRequestError(
                "sample_first_token is served on Engine.Generate only (the first tokens are an "
                "output of their own there, before the result)")
        if not self._backend.info.samples_first_token:
            raise InvalidRequestError(
                f"sample_first_token: the {self._backend.info.name} backend does not sample on the sending side")
        return on_first

    def _checked_follows(
        self, request: engine_pb2.RemoteSendRequest,
        target: Awaitable[engine_pb2.RemoteSendTarget] | None, begin: int, end: int,
    ) -> _Target:
        """A send made with kv_addr_follows: refused where it cannot be served, else its
        target as the backend awaits it (checked as it comes)."""
        if target is None:
            raise InvalidRequestError(
                "kv_addr_follows is served on Engine.Generate only (the address follows there "
                "in a send_to message); a unary RemoteSend needs kv_addr_info")
        if not self._backend.info.takes_kv_addr_later:
            raise InvalidRequestError(
                f"kv_addr_follows: the {self._backend.info.name} backend needs the receiver's "
                "address with the send")
        if request.kv_addr_info:
            raise InvalidRequestError("kv_addr_follows with kv_addr_info: send the address in send_to")
        return _Target(target, begin, end)

    @map_errors
    async def StartGenerate(
        self, request: engine_pb2.StartGenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.StartGenerateResponse]:
        outputs = self._generate(request)
        try:
            async for output in outputs:
                yield generate_output_to_pb(output)
        finally:
            # Runs on finish, on error and when the caller cancels or its deadline passes
            # (grpc cancels this task): closing the stream aborts the request.
            await outputs.aclose()

    @map_errors
    async def Generate(
        self,
        request_iterator: AsyncIterator[engine_pb2.EngineGenerateRequest],
        context: aio.ServicerContext,
    ) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        multiplexer = GenerateMultiplexer(
            self._run_generate, self._stream_interval_s, self._stream_updates_per_s, calls=self)
        async for batch in multiplexer.serve(request_iterator):
            yield batch

    async def _run_generate(
        self, request: engine_pb2.StartGenerateRequest, on_output: Callable[[GenerateOutput], None]
    ) -> None:
        """One request of Engine.Generate, checked as StartGenerate checks it; its outputs go
        to `on_output` as the backend delivers them. Cancelling it aborts the request."""
        tokens, sampling = self._checked(request.request_id, request.token_ids, request.sampling)
        begin = validation.start_generate_begin(request.begin, len(tokens), continues=bool(request.continuations))
        self._check_after_kv(request)
        continuations = self._checked_continuations(request)
        self._tracker.begin_generate(request.request_id, begin)
        try:
            with _span("shim.generate", request.request_id, tracing.valid_traceparent(request.traceparent)):
                await self._backend.run_generate(request.request_id, tokens, begin, sampling, on_output,
                                                 after_kv=request.after_kv_transfer, continuations=continuations)
        finally:
            self._tracker.end_generate(request.request_id)

    async def _generate(
        self, request: engine_pb2.StartGenerateRequest
    ) -> AsyncGenerator[GenerateOutput, None]:
        """One request's outputs, checked as StartGenerate checks them (the checks raise on
        the first iteration); closing the generator early aborts the request."""
        tokens, sampling = self._checked(request.request_id, request.token_ids, request.sampling)
        begin = validation.start_generate_begin(request.begin, len(tokens), continues=bool(request.continuations))
        self._check_after_kv(request)
        continuations = self._checked_continuations(request)
        self._tracker.begin_generate(request.request_id, begin)
        span = _span("shim.generate", request.request_id, tracing.valid_traceparent(request.traceparent)).start()
        try:
            outputs = self._backend.generate(request.request_id, tokens, begin, sampling,
                                             after_kv=request.after_kv_transfer, continuations=continuations)
            try:
                async for output in outputs:
                    yield output
            finally:
                await outputs.aclose()  # type: ignore[attr-defined]
        finally:
            span.end()
            self._tracker.end_generate(request.request_id)

    def _checked_continuations(self, request: engine_pb2.StartGenerateRequest) -> tuple[Continuation, ...]:
        if request.continuations and not self._backend.info.samples_first_token:
            raise InvalidRequestError(
                f"continuations: the {self._backend.info.name} backend cannot continue another engine's choices")
        return continuations_from_pb(request)

    def _check_after_kv(self, request: engine_pb2.StartGenerateRequest) -> None:
        if request.after_kv_transfer and not self._backend.info.starts_after_kv:
            raise InvalidRequestError(
                f"after_kv_transfer: the {self._backend.info.name} backend cannot start after a KV transfer")

    @map_errors
    async def Abort(
        self, request: engine_pb2.AbortRequest, context: aio.ServicerContext
    ) -> engine_pb2.AbortResponse:
        return engine_pb2.AbortResponse(was_active=await self.abort(request.request_id))

    async def abort(self, request_id: str) -> bool:
        """Abort, as the unary call or after a call cancelled on an Engine.Generate stream."""
        validation.check_request_id(request_id)
        self._tracker.forget(request_id)
        return bool(await self._backend.abort(request_id))

    @map_errors
    async def GetStatus(
        self, request: engine_pb2.GetStatusRequest, context: aio.ServicerContext
    ) -> engine_pb2.GetStatusResponse:
        if not self.is_ready:
            raise UnavailableError("engine is still loading")
        self._backend.tell_peers(request.kv_peers)
        info = self._backend.info
        status = await self._backend.status()
        response = status_to_pb(
            status,
            backend=info.name,
            device=info.device,
            role=self._role,
            is_draining=self.is_draining,
        )
        response.serves_stream_calls = True  # Generate below takes prep_recv and remote_send
        response.starts_after_kv_transfer = info.starts_after_kv
        response.takes_kv_addr_later = info.takes_kv_addr_later
        response.samples_first_token = info.samples_first_token
        response.takes_batched_actions = True  # Generate below takes EngineGenerateRequest.batch
        return response


class _Target:
    """The send_to of a RemoteSend over [begin, end), checked as RemoteSend's own fields
    when awaited (a coroutine made only then: a send that fails first leaves none behind)."""

    def __init__(self, target: Awaitable[engine_pb2.RemoteSendTarget], begin: int, end: int) -> None:
        self._target = target
        self._begin = begin
        self._end = end

    def __await__(self) -> Generator[Any, None, SendTarget]:
        return self._checked().__await__()

    async def _checked(self) -> SendTarget:
        message = await self._target
        if not self._begin <= message.begin < self._end:
            raise InvalidRequestError(f"send_to begin={message.begin} is outside the RemoteSend's "
                                      f"window [{self._begin}, {self._end})")
        validation.check_kv_addr_info(message.kv_addr_info)
        return SendTarget(message.kv_addr_info, message.begin, message.recv_rank)


def _span(name: str, request_id: str, traceparent: str) -> tracing.Span:
    return tracing.Span(name, traceparent, {"microserving.engine_request_id": request_id})
