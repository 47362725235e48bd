"""How every gRPC hop is built: servers, channels, TLS / mutual TLS and the shared token.

Every service (shim, router, gateway) creates its servers and channels here, so security and
message-size limits are the same on every hop: router <-> shims, shim <-> shim (KV push) and
gateway <-> router. Imports grpcio only; no service code.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

logger = logging.getLogger(__name__)

# Largest gRPC message a server accepts or a channel sends; KV chunks are kept well below it.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
TOKEN_METADATA_KEY = "authorization"
# Trailing metadata of a failed engine call whose fault lies with another engine. RemoteSend
# sets "receiver" when the shim it pushed KV to could not be reached or failed mid-transfer,
# so the router blames that engine, not the sender that answered.
FAULT_METADATA_KEY = "microserving-fault"
FAULT_RECEIVER = "receiver"

# The standard services that stay callable without the shared token, so health probes
# (docker, Kubernetes) and tooling work; everything else requires it when a token is set.
UNAUTHENTICATED_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a google.rpc.Code number carried in a message (UNKNOWN if none)."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


@dataclass(frozen=True)
class TransportSettings:
    """Security and size settings of one process's gRPC servers and channels.

    tls_cert/tls_key: this process's certificate and key (PEM files); serving TLS when set.
    tls_ca: CA bundle to verify peers; on a server it turns on mutual TLS (clients must
    present a certificate signed by it), on a client it verifies the server.
    token: shared secret sent as `authorization: Bearer <token>` on every call and required
    from callers by servers (compared in constant time).
    tls_server_name: override of the name checked in the server's certificate (tests).
    """

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    token: str | None = None
    tls_server_name: str | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    @property
    def is_tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    def __repr__(self) -> str:  # never print the token
        return (
            f"TransportSettings(tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r}, "
            f"tls_ca={self.tls_ca!r}, token={'<set>' if self.token else None}, "
            f"max_message_bytes={self.max_message_bytes})"
        )


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _size_options(settings: TransportSettings) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
    ]


class TokenAuthInterceptor(aio.ServerInterceptor):
    """Rejects calls without the shared bearer token (UNAUTHENTICATED), except health and
    reflection."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if method.startswith(UNAUTHENTICATED_SERVICES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get(TOKEN_METADATA_KEY, "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given_bytes, self._expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return _deny(handler)


# A refused call's request stream is read (unparsed) until the client half-closes, at most
# this long and this many messages, before the refusal goes out: see _drain.
_REFUSAL_DRAIN_S = 1.0
_REFUSAL_DRAIN_MESSAGES = 64
_UNAUTHENTICATED = "missing or invalid credentials"


def _deny(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same streaming shape that aborts with UNAUTHENTICATED. No
    deserializers: a refused request is never parsed."""

    async def abort_unary(request: Any, context: aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)

    async def abort_unary_stream(request: Any, context: aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)
        yield  # pragma: no cover - makes this an async generator

    async def drain_and_abort(requests: AsyncIterator[bytes], context: aio.ServicerContext) -> Any:
        await _drain(requests)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)

    async def drain_and_abort_stream(
        requests: AsyncIterator[bytes], context: aio.ServicerContext
    ) -> Any:
        await _drain(requests)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)
        yield  # pragma: no cover - makes this an async generator

    if handler is None or (not handler.request_streaming and not handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(abort_unary)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(drain_and_abort_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(drain_and_abort)
    return grpc.unary_stream_rpc_method_handler(abort_unary_stream)


async def _drain(requests: AsyncIterator[bytes]) -> None:
    """Read what a refused client is still sending, so the refusal does not race its
    writes: a grpc.aio client whose write is in flight when the server ends the call reports
    INTERNAL ("Internal error from Core") instead of the server's status. Bounded, so a
    client that never half-closes cannot hold the call open."""

    async def read() -> None:
        num_messages = 0
        async for _ in requests:
            num_messages += 1
            if num_messages >= _REFUSAL_DRAIN_MESSAGES:
                return

    # asyncio.timeout, not wait_for, which in Python 3.11 can drop a cancellation
    with contextlib.suppress(TimeoutError):  # refused then, whatever the client still sends
        async with asyncio.timeout(_REFUSAL_DRAIN_S):
            await read()


def create_server(
    settings: TransportSettings,
    interceptors: Sequence[aio.ServerInterceptor] = (),
) -> aio.Server:
    """A grpc.aio server with the size limits and, when a token is set, token auth first."""
    chain: list[aio.ServerInterceptor] = []
    if settings.token:
        chain.append(TokenAuthInterceptor(settings.token))
    chain.extend(interceptors)
    return aio.server(interceptors=chain, options=_size_options(settings))


def add_port(server: aio.Server, address: str, settings: TransportSettings) -> int:
    """Bind `address` ("host:port", port 0 for any) with TLS when configured; returns the port."""
    if not settings.tls_cert:
        return server.add_insecure_port(address)
    if not settings.tls_key:
        raise ValueError("tls_cert needs tls_key")
    key, cert = _read(settings.tls_key), _read(settings.tls_cert)
    assert key is not None and cert is not None  # both paths checked above
    credentials = grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=_read(settings.tls_ca),
        require_client_auth=bool(settings.tls_ca),
    )
    return server.add_secure_port(address, credentials)


def create_channel(
    address: str,
    settings: TransportSettings,
    extra_options: Sequence[tuple[str, Any]] = (),
) -> aio.Channel:
    """A grpc.aio channel to `address`; `token_interceptors` add the token, if any, to every
    call, over TLS as over plaintext. Without a token no interceptor is installed (they cost
    time on every streamed message).

    The token is deliberately not sent as `grpc.metadata_call_credentials`: grpcio (1.85)
    destroys such a Python auth plugin from a core thread that takes the GIL while the
    closing thread holds the GIL inside `grpc_channel_destroy`, an AB-BA deadlock that froze
    a whole process (CI hung in a test closing mTLS channels after failed handshakes; see
    grpc/grpc PR 42247)."""
    options = [*_size_options(settings), *extra_options]
    if settings.tls_server_name:
        options.append(("grpc.ssl_target_name_override", settings.tls_server_name))
    interceptors: list[Any] = token_interceptors(settings.token) if settings.token else []
    if not settings.is_tls:
        return aio.insecure_channel(address, options=options, interceptors=interceptors)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(settings.tls_ca),
        private_key=_read(settings.tls_key),
        certificate_chain=_read(settings.tls_cert),
    )
    return aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


class _TokenMetadata:
    """Adds the bearer token to a call's metadata."""

    def __init__(self, token: str | None) -> None:
        self._pair = (TOKEN_METADATA_KEY, f"Bearer {token}")

    def _details(self, details: aio.ClientCallDetails) -> aio.ClientCallDetails:
        metadata = aio.Metadata(*(tuple(details.metadata or ())), self._pair)
        return aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# One class per call shape: grpc.aio files each channel interceptor under the first shape it
# matches (an if/elif chain), so a single class implementing all four would only ever see
# unary-unary calls and the streaming RPCs (StartGenerate, PushKV, Generate) would go out
# without the token.
class _UnaryUnaryToken(_TokenMetadata, aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamToken(_TokenMetadata, aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryToken(_TokenMetadata, aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamToken(_TokenMetadata, aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request_iterator)


def token_interceptors(token: str) -> list[aio.ClientInterceptor]:
    """Channel interceptors that add the bearer token to calls of every shape."""
    kinds = (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)
    return [kind(token) for kind in kinds]
