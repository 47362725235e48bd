"""An operator can follow one request from the gateway's id to the engine's: the router logs
the mapping once per request, with the request's trace id, and the engine request id it names
is the one the engine is called with."""

from __future__ import annotations

import logging
import re

import pytest
from router_stack import generate, greedy, router_settings, running_router

from engine_shim.server import ShimServer
from engine_shim.settings import ShimSettings
from microserving.v1 import router_pb2
from router import Router

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


async def test_the_router_logs_the_request_id_mapping_once_with_the_trace_id(caplog) -> None:
    shim = ShimServer(ShimSettings(backend="embedded", model="tiny", port=0, role="both"))
    seen_by_engine: list[str] = []
    start_generate = shim.servicer.StartGenerate

    async def recording_start_generate(request, context):  # type: ignore[no-untyped-def]
        seen_by_engine.append(request.request_id)
        async for message in start_generate(request, context):
            yield message

    shim.servicer.StartGenerate = recording_start_generate  # type: ignore[method-assign]
    await shim.start()
    try:
        router = Router(settings=router_settings([f"{shim.address}=both"], engine_stream=False))
        caplog.set_level(logging.DEBUG, logger="router.request_runner")
        async with running_router(router) as (_, stub):
            request = router_pb2.NewRequest(request_id="cmpl-abc-0", text="follow me", sampling=greedy(4),
                                            traceparent=TRACEPARENT)
            result = (await generate(stub, request))["cmpl-abc-0"]
        assert result.error is None and result.done is not None
    finally:
        await shim.stop(grace_s=1.0)
    lines = [r.getMessage() for r in caplog.records if "engine request ids" in r.getMessage()]
    assert len(lines) == 1
    match = re.fullmatch(r"request cmpl-abc-0 \(trace (\w+)\): engine request ids (\w+)-<attempt number from 0>",
                         lines[0])
    assert match is not None, lines[0]
    assert match.group(1) == TRACE_ID
    assert seen_by_engine == [f"{match.group(2)}-0"]
