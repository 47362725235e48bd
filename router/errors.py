"""The router's error hierarchy: every failure the router raises carries one gRPC status code,
the request field at fault (when there is one) and a plain message for clients.

Mapped once: to a RequestError event inside Router.Generate, to a status code on unary RPCs.
"""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """Base: a failure with a gRPC status code and a client-safe message."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, param: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(RouterError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ContextLengthError(RouterError):
    """The prompt (or the prompt plus max_tokens) does not fit the model's context (HTTP 400
    context_length_exceeded at the gateway)."""

    code = grpc.StatusCode.OUT_OF_RANGE


class ModelNotFoundError(RouterError):
    code = grpc.StatusCode.NOT_FOUND


class NoEngineError(RouterError):
    """No healthy engine of a needed role is in rotation."""

    code = grpc.StatusCode.UNAVAILABLE


class OverloadedError(RouterError):
    """The router's admission limit (max_inflight) is reached; the client should retry."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class EngineCallError(RouterError):
    """An engine call failed. `address` and `stage` say which call; `code` is the engine's
    status code (DEADLINE_EXCEEDED when a router-side stage deadline fired)."""

    def __init__(
        self, message: str, *, code: grpc.StatusCode, address: str, stage: str
    ) -> None:
        super().__init__(message)
        self.code = code
        self.address = address
        self.stage = stage

    @property
    def is_engine_fault(self) -> bool:
        """The engine (not the request) is at fault: take it out of rotation and retry."""
        return self.code in _ENGINE_FAULT_CODES

    @property
    def is_retryable(self) -> bool:
        return self.code in _RETRYABLE_CODES


class PreemptedTooOftenError(RouterError):
    code = grpc.StatusCode.UNAVAILABLE


_ENGINE_FAULT_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
     grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}
)
# A request that failed for one of these reasons may succeed on another engine.
_RETRYABLE_CODES = _ENGINE_FAULT_CODES | {grpc.StatusCode.RESOURCE_EXHAUSTED}
