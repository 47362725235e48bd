"""The shim's one error boundary: domain errors -> gRPC status codes, everything else ->
INTERNAL with a plain message (and the traceback in the log). Wraps unary and streaming
handlers alike."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from grpc import aio

from engine_shim.engine.api import (
    AlreadyExistsError,
    EngineError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
from microserving.transport import FAULT_METADATA_KEY

logger = logging.getLogger(__name__)

# Most specific first: AlreadyExistsError subclasses InvalidRequestError.
_CODES: tuple[tuple[type[EngineError], grpc.StatusCode], ...] = (
    (AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
)

F = TypeVar("F", bound=Callable[..., Any])


def status_code_for(error: EngineError) -> grpc.StatusCode:
    for error_type, code in _CODES:
        if isinstance(error, error_type):
            return code
    return grpc.StatusCode.INTERNAL


async def _abort_for(error: Exception, context: aio.ServicerContext, method: str) -> None:
    code = status_code_for(error) if isinstance(error, EngineError) else grpc.StatusCode.INTERNAL
    fault = getattr(error, "fault", None)  # another engine is at fault (kv_plane/sender.py)
    if fault:
        context.set_trailing_metadata(((FAULT_METADATA_KEY, fault),))
    if code != grpc.StatusCode.INTERNAL:
        await context.abort(code, str(error) or type(error).__name__)
    logger.error("unexpected error in %s", method, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error")


def map_errors(handler: F) -> F:
    """Decorate a servicer method (coroutine or async generator) with the error mapping."""
    name = handler.__qualname__
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream(
            self: Any, request: Any, context: aio.ServicerContext
        ) -> AsyncIterator[Any]:
            try:
                async for item in handler(self, request, context):
                    yield item
            except aio.AbortError:
                raise
            except Exception as error:  # noqa: BLE001 - the boundary maps every error once
                await _abort_for(error, context, name)

        return stream  # type: ignore[return-value]

    @functools.wraps(handler)
    async def unary(self: Any, request: Any, context: aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - the boundary maps every error once
            await _abort_for(error, context, name)

    return unary  # type: ignore[return-value]
