"""The Router service around the patterns: health reflects the roles the pattern needs,
ListModels / GetStatus / reflection, stream-level and per-request errors, context migration,
and the `microserving router` entry point as a subprocess."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from router_stack import REPO, generate, greedy, router_settings, running_router

from microserving.stack.process import LISTENING
from microserving.tokenizer import Tokenizer
from microserving.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.router import Router

pytestmark = pytest.mark.integration


async def _health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        return reply.status


async def test_health_is_serving_only_with_every_needed_role(shims) -> None:
    only_prefill = Router(settings=router_settings([f"{shims[0].address}=prefill"], pattern="disagg"))
    async with running_router(only_prefill) as (running, _):
        assert await _health(running.port) == health_pb2.HealthCheckResponse.NOT_SERVING
    both = Router(settings=router_settings([f"{shims[0].address}=prefill", f"{shims[1].address}=decode"], pattern="disagg"))
    async with running_router(both) as (running, _):
        assert await _health(running.port) == health_pb2.HealthCheckResponse.SERVING


async def test_list_models_status_and_reflection(shims) -> None:
    engines = [f"{shims[0].address}=prefill", f"{shims[1].address}=decode"]
    router = Router(settings=router_settings(engines, pattern="disagg", pd_balance_factor=0.25))
    async with running_router(router) as (running, stub):
        models = await stub.ListModels(router_pb2.ListModelsRequest())
        status = await stub.GetStatus(router_pb2.RouterGetStatusRequest())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            services = [s.name async for reply in call for s in reply.list_services_response.service]
    assert [m.id for m in models.models] == ["tiny"] and models.models[0].max_context_length > 0
    assert status.pattern == router_pb2.PATTERN_DISAGG and status.pd_balance_factor == pytest.approx(0.25)
    assert [e.address for e in status.engines] == [shims[0].address, shims[1].address]
    assert all(e.health == router_pb2.ENGINE_HEALTH_SERVING and e.num_total_kv_pages > 0 for e in status.engines)
    assert "microserving.v1.Router" in services and "grpc.health.v1.Health" in services


async def test_malformed_stream_message_ends_call_with_invalid_argument(shims) -> None:
    router = Router(settings=router_settings([f"{shims[0].address}=both"], pattern="round-robin"))
    async with running_router(router) as (_, stub):
        for bad in (router_pb2.GenerateRequest(), router_pb2.GenerateRequest(generate=router_pb2.NewRequest(text="x"))):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Generate(iter([bad])):
                    pass
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_bad_request_gets_its_own_error_and_others_carry_on(shims) -> None:
    router = Router(settings=router_settings([f"{shims[0].address}=decode"], pattern="round-robin"))
    async with running_router(router) as (_, stub):
        results = await generate(
            stub,
            router_pb2.NewRequest(request_id="bad", text="x", sampling=common_pb2.SamplingParams(temperature=9)),
            router_pb2.NewRequest(request_id="unknown-model", text="x", model="nope"),
            router_pb2.NewRequest(request_id="no-prefill", text="x",
                                  hints=router_pb2.PatternHints(pattern=router_pb2.PATTERN_DISAGG)),
            router_pb2.NewRequest(request_id="good", text="fine", sampling=greedy()),
        )
    assert (results["bad"].error.code, results["bad"].error.param) == (3, "sampling.temperature")
    assert results["unknown-model"].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    # disagg with no prefill engine in rotation degrades to the decode engine alone
    assert results["no-prefill"].error is None and list(results["no-prefill"].done.engines) == [shims[0].address]
    assert results["good"].error is None and results["good"].done is not None


async def test_migrate_context_lands_the_prefix_in_the_target_cache(shims) -> None:
    source, target = shims[2], shims[3]
    engines = [f"{source.address}=both", f"{target.address}=both"]
    ids = Tokenizer.from_model("tiny").encode("a context worth moving between engines, " * 3)
    router = Router(settings=router_settings(engines, pattern="round-robin"))
    async with running_router(router) as (_, stub):
        request = router_pb2.MigrateContextRequest(
            token_ids=router_pb2.TokenIds(ids=ids), source=source.address, target=target.address
        )
        first = await stub.MigrateContext(request)
        again = await stub.MigrateContext(request)
    assert first.source == source.address and first.num_tokens_moved == len(ids) - 1 - first.prefix_matched_length
    assert first.num_tokens_moved > 0
    assert again.prefix_matched_length >= len(ids) - 1 - 16  # all but a partial page is cached now
    assert again.num_tokens_moved < first.num_tokens_moved


@pytest.mark.e2e
async def test_router_entry_point_serves_on_port_0(shims) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "MICROSERVING_ROUTER_PATTERN": "disagg"}
    process = subprocess.Popen(
        [sys.executable, "-m", "microserving.cli", "router", "--engine", f"{shims[0].address}=prefill",
         "--engine", f"{shims[1].address}=decode", "--model", "tiny", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), 60)
        match = LISTENING.search(line)
        assert match, line
        async with grpc.aio.insecure_channel(f"{match['host']}:{match['port']}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            status = await stub.GetStatus(router_pb2.RouterGetStatusRequest())
            results = await generate(stub, router_pb2.NewRequest(request_id="e", text="entry point", sampling=greedy()))
        assert status.pattern == router_pb2.PATTERN_DISAGG
        assert results["e"].error is None and len(results["e"].done.engines) == 2
    finally:
        process.terminate()
        process.wait(timeout=20)
    assert process.returncode == 0


async def test_reflection_v1_answers_beside_v1alpha(shims) -> None:
    """grpc.reflection.v1 (what grpcurl and buf curl ask for first): the Python client on the
    v1 method path, and `buf curl --reflect-protocol grpc-v1` where buf is installed."""
    router = Router(settings=router_settings([f"{shims[0].address}=both"], pattern="round-robin"))
    async with running_router(router) as (running, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            v1 = channel.stream_stream(
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            call = v1(iter([reflection_pb2.ServerReflectionRequest(list_services=""),
                            reflection_pb2.ServerReflectionRequest(file_containing_symbol="microserving.v1.Router")]))
            replies = [reply async for reply in call]
        services = {s.name for s in replies[0].list_services_response.service}
        assert {"microserving.v1.Router", "grpc.reflection.v1alpha.ServerReflection"} <= services
        assert replies[1].file_descriptor_response.file_descriptor_proto  # the router.proto file
        buf = REPO / "tools" / "node_modules" / ".bin" / "buf"
        if not buf.exists():
            return
        listed = await asyncio.to_thread(subprocess.run, [
            str(buf), "curl", "--protocol", "grpc", "--http2-prior-knowledge", "--reflect-protocol",
            "grpc-v1", "--list-methods", f"http://127.0.0.1:{running.port}"],
            capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert "microserving.v1.Router/Generate" in listed.stdout
