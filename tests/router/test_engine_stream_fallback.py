"""A router on the engine stream meets a shim from before Engine.Generate (the RPC answers
UNIMPLEMENTED): the request in flight is run again through StartGenerate, later requests use
StartGenerate straight away, and the tokens are the engine's own."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio
from router_stack import engine_alone, generate, greedy, router_settings, running_router

from engine_shim.server import ShimServer
from engine_shim.settings import ShimSettings
from microserving.v1 import engine_pb2, router_pb2
from router import Router

pytestmark = pytest.mark.integration


async def _unimplemented(
    request_iterator: AsyncIterator[engine_pb2.EngineGenerateRequest], context: aio.ServicerContext
) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    yield engine_pb2.EngineGenerateResponse()  # not reached; makes this an async generator


async def test_an_engine_without_the_stream_is_served_through_start_generate() -> None:
    shim = ShimServer(ShimSettings(backend="embedded", model="tiny", port=0, role="both"))
    shim.servicer.Generate = _unimplemented  # type: ignore[method-assign]
    await shim.start()
    try:
        router = Router(settings=router_settings([f"{shim.address}=both"], engine_stream=True))
        async with running_router(router) as (_, stub):
            requests = [router_pb2.NewRequest(request_id=f"old-shim-{i}", token_ids=router_pb2.TokenIds(ids=ids),
                                              sampling=greedy(8))
                        for i, ids in enumerate(([1, 40, 41, 42, 43], [1, 50, 51, 52]))]
            results = [(await generate(stub, request))[request.request_id] for request in requests]
            assert not router.engines.stream(router.registry.endpoints[0]).is_supported
        for request, result in zip(requests, results, strict=True):
            assert result.error is None, result.error
            want = await engine_alone(shim.address, list(request.token_ids.ids), greedy(8), f"ref-{request.request_id}")
            assert result.token_ids == want
    finally:
        await shim.stop(grace_s=1.0)
