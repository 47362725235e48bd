"""gRPC server reflection under both names clients ask for: `grpc.reflection.v1alpha` (what
grpcio-reflection implements) and `grpc.reflection.v1` (what grpcurl, buf curl and newer
clients try first). grpcio-reflection ships no v1 servicer, but the two protocols are the same
messages under another package name (same fields and numbers), so the v1alpha servicer
answers v1 calls byte for byte; v1 is registered here as a generic handler over it."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc import aio
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as messages

SERVICE_NAME_V1 = "grpc.reflection.v1.ServerReflection"


def enable_server_reflection(service_names: Sequence[str], server: aio.Server) -> None:
    """Reflection (v1 and v1alpha) over `service_names` and the v1alpha service. The v1 name
    is served but not listed: its descriptor is not in the pool (grpcio-reflection has none),
    and clients that describe every listed service (buf curl) fail on one they cannot find."""
    names = (*service_names, reflection.SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=messages.ServerReflectionRequest.FromString,
        response_serializer=messages.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME_V1, {"ServerReflectionInfo": handler}),))
