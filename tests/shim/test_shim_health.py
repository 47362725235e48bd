"""The standard services and the shim's life cycle: grpc.health.v1 (NOT_SERVING while the
engine loads, SERVING after, NOT_SERVING while draining) and reflection answer with their
standard clients; SIGTERM lets an in-flight stream finish, then the process exits."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from shim_helpers import PROMPT, engine_stub, generate, greedy, start_shim

from engine_shim.server import ShimServer
from engine_shim.settings import ShimSettings
from microserving.v1 import engine_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("", "microserving.v1.Engine", "microserving.v1.KVTransfer")


@pytest.mark.e2e
def test_health_and_reflection_answer_with_the_standard_clients(decode_shim):
    with grpc.insecure_channel(decode_shim.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        statuses = {
            name: health.Check(health_pb2.HealthCheckRequest(service=name)).status
            for name in SERVICES
        }
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        engine = DescriptorPool(database).FindServiceByName("microserving.v1.Engine")
        method = engine.methods_by_name["StartGenerate"]
    assert statuses == dict.fromkeys(SERVICES, SERVING)
    assert {
        "microserving.v1.Engine",
        "microserving.v1.KVTransfer",
        "grpc.health.v1.Health",
    } <= services
    assert method.output_type.full_name == "microserving.v1.StartGenerateResponse"


@pytest.mark.integration
async def test_health_is_not_serving_while_loading_and_while_draining():
    server = ShimServer(ShimSettings(port=0))
    starting = asyncio.create_task(server.start())
    while server.port == 0:
        await asyncio.sleep(0.005)
    channel = grpc.aio.insecure_channel(server.address)
    health = health_pb2_grpc.HealthStub(channel)
    _, stub = engine_stub(server.address)
    while_loading = (await health.Check(health_pb2.HealthCheckRequest(service=""))).status
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetStatus(engine_pb2.GetStatusRequest())
    await starting
    after_start = (
        await health.Check(health_pb2.HealthCheckRequest(service="microserving.v1.Engine"))
    ).status
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    assert (await watch.read()).status == SERVING
    stopping = asyncio.create_task(server.stop(grace_s=1.0))
    while_draining = (await watch.read()).status
    await stopping
    await channel.close()
    assert while_loading == NOT_SERVING and caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert after_start == SERVING and while_draining == NOT_SERVING


@pytest.mark.e2e
async def test_sigterm_lets_the_in_flight_stream_finish_then_exits(tmp_path):
    shim = start_shim(tmp_path, "drain", "--drain-grace-s", "30")
    try:
        channel, stub = engine_stub(shim.address)
        async with channel:
            request = engine_pb2.StartGenerateRequest(
                request_id="drain", token_ids=PROMPT, sampling=greedy(max_tokens=40)
            )
            ids: list[int] = []
            async for response in stub.StartGenerate(request):
                if not ids:
                    shim.process.send_signal(signal.SIGTERM)
                for choice in response.choices:
                    ids.extend(choice.token_ids)
        exit_code = await asyncio.to_thread(shim.process.wait, 30)
    finally:
        shim.stop()
    assert len(ids) == 40 and exit_code == 0


@pytest.mark.e2e
async def test_a_draining_shim_refuses_new_requests(tmp_path):
    shim = start_shim(tmp_path, "refuse", "--drain-grace-s", "30")
    try:
        channel, stub = engine_stub(shim.address)
        async with channel:
            long_call = stub.StartGenerate(
                engine_pb2.StartGenerateRequest(
                    request_id="long", token_ids=PROMPT, sampling=greedy(max_tokens=1500)
                )
            )
            await long_call.read()  # streaming
            shim.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await generate(stub, "late", PROMPT)
            is_still_streaming = long_call.done() is False
            long_call.cancel()  # the drain then ends without waiting for its grace period
            exit_code = await asyncio.to_thread(shim.process.wait, 10)
    finally:
        shim.stop()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert is_still_streaming and exit_code == 0
