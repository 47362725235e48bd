"""The MLC-wire-compatible FastAPI app: /microserving/prep_recv, /remote_send,
/start_generate, /v1/completions, /v1/models (MLC's exact JSON), the internal KV route, and
one exception handler that turns domain errors into OpenAI error bodies."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine_shim import validation
from engine_shim.engine.api import (
    AlreadyExistsError,
    Delta,
    EngineError,
    FailedPreconditionError,
    GenerateOutput,
    InvalidRequestError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    Usage,
)
from engine_shim.mlc_http import kv_relay
from engine_shim.mlc_http.protocol import (
    ChoiceLogprobs,
    CompletionRequest,
    PrepRecvRequest,
    RemoteSendRequest,
    StartGenerateRequest,
    choice_json,
    completion_json,
    usage_json,
)
from engine_shim.mlc_http.request_metrics import RequestMetrics
from engine_shim.mlc_http.service import CompatService
from engine_shim.mlc_http.settings import MLCCompatSettings

logger = logging.getLogger(__name__)

_HTTP_STATUS: tuple[tuple[type[EngineError], int, str], ...] = (
    (AlreadyExistsError, 409, "conflict"),
    (InvalidRequestError, 400, "invalid_request_error"),
    (NotFoundError, 404, "not_found_error"),
    (FailedPreconditionError, 409, "failed_precondition"),
    (ResourceExhaustedError, 429, "overloaded_error"),
    (UnavailableError, 503, "unavailable_error"),
)


def _error_body(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": None, "code": status}},
    )


async def _engine_error(request: Request, error: Exception) -> JSONResponse:
    for error_type, status, kind in _HTTP_STATUS:
        if isinstance(error, error_type):
            return _error_body(status, kind, str(error))
    logger.error("unexpected error on %s", request.url.path, exc_info=error)
    return _error_body(500, "internal_error", "internal error")


def _sse(payload: dict[str, Any]) -> bytes:
    # orjson (the shim parses MLC's SSE with it too): one chunk per running request per step,
    # each with a logprobs entry when the MLC shim asks for the ids, and the standard
    # library's encoder was the largest cost of the server's thread beside its socket writes
    # (bench mlc-relay's profile).
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class _Completion:
    """Turns engine outputs into CompletionResponse JSON, streamed or collected. The id is the
    request's `user` when it has one, as MLC's engines answer."""

    def __init__(self, service: CompatService, request: CompletionRequest, request_id: str) -> None:
        self.id = request_id
        self.model = service.model_id
        self.token_bytes = service.token_bytes
        self.with_logprobs = request.logprobs is not None
        self.include_usage = bool(request.stream_options and request.stream_options.include_usage)
        self.logprobs: dict[int, ChoiceLogprobs] = {}
        self.metrics = RequestMetrics()

    def choice(self, delta: Delta) -> dict[str, Any]:
        if delta.token_ids:
            self.metrics.saw_tokens()
        if not self.with_logprobs:
            return choice_json(delta, None)
        builder = self.logprobs.setdefault(delta.index, ChoiceLogprobs(self.token_bytes))
        return choice_json(delta, builder.add(delta))

    def usage(self, usage: Usage) -> dict[str, Any]:
        return usage_json(usage, self.metrics.extra(usage))

    async def stream(self, outputs: AsyncIterator[GenerateOutput]) -> AsyncIterator[bytes]:
        async for output in outputs:
            if output.deltas:
                choices = [self.choice(d) for d in output.deltas]
                yield _sse(completion_json(self.id, self.model, choices, None))
            if output.usage is not None and self.include_usage:
                yield _sse(completion_json(self.id, self.model, [], self.usage(output.usage)))
        yield b"data: [DONE]\n\n"

    async def collect(self, outputs: AsyncIterator[GenerateOutput]) -> dict[str, Any]:
        choices: dict[int, dict[str, Any]] = {}
        usage: dict[str, Any] | None = None
        async for output in outputs:
            for delta in output.deltas:
                piece = self.choice(delta)
                merged = choices.get(delta.index)
                if merged is None:
                    choices[delta.index] = piece
                    continue
                merged["text"] += piece["text"]
                merged["finish_reason"] = piece["finish_reason"]
                if self.with_logprobs:
                    for key, values in piece["logprobs"].items():
                        merged["logprobs"][key] += values
            if output.usage is not None:
                usage = self.usage(output.usage)
        return completion_json(self.id, self.model, [choices[i] for i in sorted(choices)], usage)


def create_app(settings: MLCCompatSettings) -> FastAPI:
    service = CompatService(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        yield
        await service.stop()

    app = FastAPI(title="microserving mlc-compat", lifespan=lifespan)
    app.state.service = service
    app.add_exception_handler(EngineError, _engine_error)
    app.add_exception_handler(Exception, _engine_error)

    async def respond(request: CompletionRequest, begin: int, needs_user: bool) -> Any:
        request_id, tokens, sampling = service.checked(request, needs_user=needs_user)
        begin = validation.start_generate_begin(begin, len(tokens))
        completion = _Completion(service, request, request_id)
        outputs = service.generate(request_id, tokens, begin, sampling)
        if request.stream:
            return StreamingResponse(completion.stream(outputs), media_type="text/event-stream")
        return await completion.collect(outputs)

    @app.post("/microserving/prep_recv")
    async def prep_recv(request: PrepRecvRequest) -> dict[str, object]:
        return await service.prep_recv(request)

    @app.post("/microserving/remote_send")
    async def remote_send(request: RemoteSendRequest) -> dict[str, object]:
        return await service.remote_send(request)

    @app.post("/microserving/start_generate")
    async def start_generate(request: StartGenerateRequest) -> Any:
        return await respond(request, request.begin, needs_user=True)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> Any:
        return await respond(request, 0, needs_user=False)

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        card = {
            "id": service.model_id,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "MLC-LLM",
        }
        return {"object": "list", "data": [card]}

    @app.post(kv_relay.PUSH_KV_PATH)
    async def push_kv(request: Request) -> dict[str, object]:
        return await service.receive_kv(dict(request.headers), await request.body())

    return app
