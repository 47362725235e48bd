"""The gateway's one error boundary: every failure becomes an OpenAI error body here.

Code raises `GatewayError` (or lets a gRPC error / a validation error escape); the handlers
installed by `install_error_handlers` turn each into `{"error": {message, type, param, code}}`
with the status OpenAI clients expect. gRPC status codes are mapped in exactly one table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.protocol.base import ErrorInfo, ErrorResponse
from microserving.transport import status_code

logger = logging.getLogger(__name__)

# Seconds a client should wait before retrying an overloaded gateway or router.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ErrorKind:
    status: int
    type: str
    code: str


INVALID = ErrorKind(400, "invalid_request_error", "invalid_request")
UNAUTHENTICATED = ErrorKind(401, "authentication_error", "invalid_api_key")
NOT_FOUND = ErrorKind(404, "not_found_error", "model_not_found")
# 400, as OpenAI and vLLM answer: the SDK raises BadRequestError and litellm recognises the
# code as its ContextWindowExceededError.
TOO_LONG = ErrorKind(400, "invalid_request_error", "context_length_exceeded")
BODY_TOO_LARGE = ErrorKind(413, "invalid_request_error", "request_too_large")
BODY_TIMEOUT = ErrorKind(408, "invalid_request_error", "request_timeout")
OVERLOADED = ErrorKind(429, "rate_limit_error", "rate_limit_exceeded")
INTERNAL = ErrorKind(500, "internal_error", "internal_error")
UNAVAILABLE = ErrorKind(503, "service_unavailable_error", "service_unavailable")
TIMEOUT = ErrorKind(504, "timeout_error", "timeout")

# The single table from gRPC status codes to HTTP errors.
_BY_GRPC_CODE: dict[grpc.StatusCode, ErrorKind] = {
    grpc.StatusCode.INVALID_ARGUMENT: INVALID,
    grpc.StatusCode.FAILED_PRECONDITION: INVALID,
    grpc.StatusCode.ALREADY_EXISTS: INVALID,
    grpc.StatusCode.UNAUTHENTICATED: UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED: UNAUTHENTICATED,
    grpc.StatusCode.NOT_FOUND: NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE: TOO_LONG,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OVERLOADED,
    grpc.StatusCode.UNAVAILABLE: UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: TIMEOUT,
}


class GatewayError(Exception):
    """A failure with an OpenAI error body; raised anywhere, rendered once."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    @property
    def status(self) -> int:
        return self.kind.status

    def body(self) -> ErrorResponse:
        info = ErrorInfo(message=self.message, type=self.kind.type, param=self.param,
                         code=self.kind.code)
        return ErrorResponse(error=info)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.kind is OVERLOADED else {}


# The router names the fields of its proto request; a client knows its JSON request's names.
_CLIENT_PARAMS: dict[str, tuple[str, str]] = {  # router param -> (completions, chat)
    "input": ("prompt", "messages"),
    "text": ("prompt", "messages"),
    "token_ids.ids": ("prompt", "messages"),
    "chat.messages": ("prompt", "messages"),
    "sampling.top_logprobs": ("logprobs", "top_logprobs"),
    "sampling.max_tokens": ("max_tokens", "max_tokens"),
    "request_id": ("user", "user"),
}


def client_param(param: str | None, *, is_chat: bool) -> str | None:
    """The field of the client's request that a router (or gateway) param names."""
    if param is None:
        return None
    if param in _CLIENT_PARAMS:
        return _CLIENT_PARAMS[param][int(is_chat)]
    return param.removeprefix("sampling.")


def from_grpc(code: grpc.StatusCode, message: str, param: str = "") -> GatewayError:
    """The HTTP error for a gRPC status; unknown codes are internal errors."""
    kind = _BY_GRPC_CODE.get(code, INTERNAL)
    if kind is INTERNAL:
        logger.error("router answered %s: %s", code.name, message)
        message = "internal error in the serving backend"
    return GatewayError(kind, message or code.name.lower(), param or None)


def from_code_number(number: int, message: str, param: str = "") -> GatewayError:
    """The HTTP error for a RequestError's numeric google.rpc.Code."""
    return from_grpc(status_code(number), message, param)


def from_rpc_error(error: grpc.aio.AioRpcError) -> GatewayError:
    """A failed router call (e.g. UNAVAILABLE while the router is down)."""
    if error.code() is grpc.StatusCode.UNAVAILABLE:
        return GatewayError(UNAVAILABLE, "the router is not reachable")
    return from_grpc(error.code(), error.details() or "")


def _param_of(loc: tuple[int | str, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # Drop pydantic's union-branch labels such as "str" or "list[int]".
    parts = [p for p in parts if not any(c in p for c in "[]") and p not in ("str", "int")]
    return ".".join(parts) or None


def _validation_error(exc: RequestValidationError) -> GatewayError:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":  # its loc is a character position, not a field
        return GatewayError(INVALID, f"the body is not valid JSON: {first.get('msg', '')}")
    param = _param_of(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request"))
    message = f"{param}: {message}" if param else message
    return GatewayError(INVALID, message, param)


def render(error: GatewayError) -> JSONResponse:
    return JSONResponse(error.body().model_dump(mode="json"), status_code=error.status,
                        headers=error.headers())


def _http_kind(status: int) -> ErrorKind:
    """Starlette's own HTTP errors (unknown route 404, wrong method 405, ...)."""
    if status >= 500:
        return INTERNAL
    return ErrorKind(status, "not_found_error" if status == 404 else "invalid_request_error",
                     "not_found" if status == 404 else "http_error")


def install_error_handlers(app: FastAPI, on_error: Callable[[GatewayError], None]) -> None:
    """The one place where exceptions become HTTP responses; `on_error` counts each."""

    def respond(error: GatewayError) -> JSONResponse:
        on_error(error)
        return render(error)

    async def on_gateway_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, GatewayError)  # registered for this type only
        exc.param = client_param(exc.param, is_chat=request.url.path.endswith("/chat/completions"))
        return respond(exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return respond(_validation_error(exc))

    async def on_rpc_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, grpc.aio.AioRpcError)
        return respond(from_rpc_error(exc))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return respond(GatewayError(_http_kind(exc.status_code), str(exc.detail)))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return respond(GatewayError(INTERNAL, "internal error"))

    app.add_exception_handler(GatewayError, on_gateway_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(grpc.aio.AioRpcError, on_rpc_error)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
