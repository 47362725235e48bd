"""Every gRPC hop with mutual TLS and the shared token: a disaggregated stack (gateway ->
router -> prefill / decode shims, KV pushed shim to shim) configured only through the
services' own MICROSERVING_<SVC>_TLS_* / _TOKEN settings serves requests, while callers
without credentials are refused: plaintext, no client certificate or one from another CA
fail the handshake (UNAVAILABLE); a valid certificate without the token gets UNAUTHENTICATED
from RemoteSend, PushKV, Abort and Router.Generate. Every service listens on loopback only."""

from __future__ import annotations

import asyncio
import ipaddress
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from stack_procs import Service, start_gateway, start_router, start_shims, stop_all
from tls_certs import NodeFiles, make_node

from microserving.transport import TransportSettings, create_channel
from microserving.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.e2e

TOKEN = "internal-token-7f3a9c"


def _env(prefix: str, node: NodeFiles) -> dict[str, str]:
    return {f"MICROSERVING_{prefix}_TLS_CERT": node.cert, f"MICROSERVING_{prefix}_TLS_KEY": node.key,
            f"MICROSERVING_{prefix}_TLS_CA": node.ca, f"MICROSERVING_{prefix}_TOKEN": TOKEN}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NodeFiles]:
    directory: Path = tmp_path_factory.mktemp("certs")
    return {"good": make_node(directory, "good"), "rogue": make_node(directory, "rogue")}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, certs: dict[str, NodeFiles]) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("mtls")
    node = certs["good"]
    prefill, decode = start_shims(logs, ["prefill", "decode"], env=_env("SHIM", node))
    router = start_router(logs, [f"{prefill.address}=prefill", f"{decode.address}=decode"],
                          "--pattern", "disagg", env=_env("ROUTER", node))
    gateway = start_gateway(logs, router.address, env=_env("GATEWAY", node))
    services = {"prefill": prefill, "decode": decode, "router": router, "gateway": gateway}
    yield services
    stop_all(services.values())


def _transport(node: NodeFiles | None, token: str | None = TOKEN, with_cert: bool = True) -> TransportSettings:
    if node is None:
        return TransportSettings(token=token)
    if not with_cert:
        return TransportSettings(tls_ca=node.ca, token=token)
    return TransportSettings(tls_cert=node.cert, tls_key=node.key, tls_ca=node.ca, token=token)


async def _engine_code(address: str, transport: TransportSettings, method: str) -> grpc.StatusCode:
    async with create_channel(address, transport) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        kv = engine_pb2_grpc.KVTransferStub(channel)
        try:
            if method == "RemoteSend":
                await stub.RemoteSend(engine_pb2.RemoteSendRequest(
                    request_id="x", token_ids=[10, 11, 12], begin=0, end=-1, kv_addr_info=b"x"), timeout=5)
            elif method == "PushKV":
                await kv.PushKV(iter(_push_messages()), timeout=5)
            elif method == "Abort":
                await stub.Abort(engine_pb2.AbortRequest(request_id="x"), timeout=5)
            else:
                await stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def _router_code(address: str, transport: TransportSettings, send: bool = False) -> grpc.StatusCode:
    """The status of one Generate call (a request sent, or nothing)."""
    async with create_channel(address, transport) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(generate=router_pb2.NewRequest(request_id="x", text="hi"))
        try:
            async for _ in stub.Generate(iter([request] if send else []), timeout=120):
                pass
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def test_mtls_and_token_on_every_hop_serve_a_disaggregated_request(stack) -> None:
    async with httpx.AsyncClient(base_url=f"http://{stack['gateway'].address}", timeout=60) as client:
        reply = await client.post("/v1/completions", json={
            "prompt": "a prompt that needs its KV moved between shims " * 3, "max_tokens": 8,
            "ignore_eos": True, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8
    assert "KV push" not in stack["prefill"].log()  # the shim-to-shim push did not fail


@pytest.mark.parametrize("method", ["RemoteSend", "PushKV", "Abort"])
async def test_shim_refuses_callers_without_credentials(stack, certs, method: str) -> None:
    shim = stack["decode"].address
    good, rogue = certs["good"], certs["rogue"]
    # The handshake fails per connection, before any method: checked with the unary Abort
    # (a refused streaming call may surface as a local cancel in grpc.aio, hiding the code).
    assert await _engine_code(shim, _transport(None, token=TOKEN), "Abort") == grpc.StatusCode.UNAVAILABLE
    assert await _engine_code(shim, _transport(good, with_cert=False), "Abort") == grpc.StatusCode.UNAVAILABLE
    rogue_client = TransportSettings(tls_cert=rogue.cert, tls_key=rogue.key, tls_ca=good.ca, token=TOKEN)
    assert await _engine_code(shim, rogue_client, "Abort") == grpc.StatusCode.UNAVAILABLE
    assert await _engine_code(shim, _transport(good, token=None), method) == grpc.StatusCode.UNAUTHENTICATED
    assert await _engine_code(shim, _transport(good, token="wrong"), method) == grpc.StatusCode.UNAUTHENTICATED
    with_credentials = await _engine_code(shim, _transport(good), method)
    assert with_credentials not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE)


async def test_router_refuses_callers_without_credentials(stack, certs) -> None:
    router = stack["router"].address
    good, rogue = certs["good"], certs["rogue"]
    rogue_client = TransportSettings(tls_cert=rogue.cert, tls_key=rogue.key, tls_ca=good.ca, token=TOKEN)
    for refused in (_transport(None), _transport(good, with_cert=False), rogue_client):
        assert await _list_models_code(router, refused) == grpc.StatusCode.UNAVAILABLE
    assert await _router_code(router, _transport(good, token=None)) == grpc.StatusCode.UNAUTHENTICATED
    assert await _router_code(router, _transport(good), send=True) == grpc.StatusCode.OK


async def _list_models_code(address: str, transport: TransportSettings) -> grpc.StatusCode:
    async with create_channel(address, transport) as channel:
        try:
            await router_pb2_grpc.RouterStub(channel).ListModels(router_pb2.ListModelsRequest(), timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # grpc binds 127.0.0.1 as ::ffff:127.0.0.1
    return bool((mapped or address).is_loopback)


def test_every_service_listens_on_loopback_only(stack) -> None:
    for name, service in stack.items():
        listening = [c.laddr for c in psutil.Process(service.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening, name
        assert all(_is_loopback(address.ip) for address in listening), (name, listening)


def test_token_and_keys_never_reach_the_logs(stack) -> None:
    for name, service in stack.items():
        assert TOKEN not in service.log(), name


@pytest.fixture(scope="module")
def token_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    """The shared token and no TLS: the token alone guards every hop."""
    logs = tmp_path_factory.mktemp("token-only")
    prefill, decode = start_shims(logs, ["prefill", "decode"], env={"MICROSERVING_SHIM_TOKEN": TOKEN})
    router = start_router(logs, [f"{prefill.address}=prefill", f"{decode.address}=decode"],
                          "--pattern", "disagg", env={"MICROSERVING_ROUTER_TOKEN": TOKEN})
    gateway = start_gateway(logs, router.address, env={"MICROSERVING_GATEWAY_TOKEN": TOKEN})
    services = {"prefill": prefill, "decode": decode, "router": router, "gateway": gateway}
    yield services
    stop_all(services.values())


async def test_token_alone_carries_every_call_shape_through_the_stack(token_stack) -> None:
    """Generate (bidi), StartGenerate (server stream) and PushKV (client stream) carry it."""
    async with httpx.AsyncClient(base_url=f"http://{token_stack['gateway'].address}", timeout=60) as client:
        reply = await client.post("/v1/completions", json={
            "prompt": "token only, KV pushed between shims " * 3, "max_tokens": 6, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 6
    assert await _router_code(token_stack["router"].address, TransportSettings()) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("method", ["RemoteSend", "PushKV", "Abort", "GetStatus"])
async def test_token_alone_guards_every_engine_call(token_stack, method: str) -> None:
    address = token_stack["decode"].address
    assert await _engine_code(address, TransportSettings(), method) == grpc.StatusCode.UNAUTHENTICATED
    assert await _engine_code(address, TransportSettings(token="wrong"), method) == grpc.StatusCode.UNAUTHENTICATED
    assert await _engine_code(address, TransportSettings(token=TOKEN), method) != grpc.StatusCode.UNAUTHENTICATED


REFUSAL_ROUNDS = 60


def _push_messages() -> list[engine_pb2.PushKVRequest]:
    header = engine_pb2.KVPushHeader(request_id="x", reservation_token="t")
    chunks = [engine_pb2.KVChunkData(begin=i, num_tokens=1, data=b"k" * 4096) for i in range(3)]
    return [engine_pb2.PushKVRequest(header=header)] + [engine_pb2.PushKVRequest(chunk=c) for c in chunks]


def _engine_generate(request_id: str) -> engine_pb2.EngineGenerateRequest:
    start = engine_pb2.StartGenerateRequest(request_id=request_id, token_ids=[5, 6, 7],
                                            sampling=common_pb2.SamplingParams(max_tokens=4))
    return engine_pb2.EngineGenerateRequest(start=start)


async def _final_code(call: grpc.aio.Call, writes: list[object] | None = None) -> str:
    """The status a client finally sees (its writes first, if any, then reading to the end)."""
    try:
        for message in writes or []:
            await call.write(message)  # type: ignore[attr-defined]
        if writes is not None:
            await call.done_writing()  # type: ignore[attr-defined]
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[attr-defined]
                pass
        else:
            await call
    except (grpc.aio.AioRpcError, Exception):  # noqa: BLE001 - the status below says what happened
        pass
    return (await call.code()).name


async def test_a_refused_stream_says_unauthenticated_while_the_client_is_still_writing(token_stack) -> None:
    """A grpc.aio client whose write is in flight when the server ends the call reports INTERNAL
    ("Internal error from Core") instead of the server's code; the token check reads what a
    refused stream still sends before it refuses, so every tokenless call that writes
    requests (bidi Engine.Generate and Router.Generate, client-streaming PushKV) sees
    UNAUTHENTICATED (before: 40-75% of these concurrent bidi calls and some pushes got INTERNAL)."""
    codes: Counter[tuple[str, str]] = Counter()
    new = router_pb2.GenerateRequest(generate=router_pb2.NewRequest(request_id="x", text="hi"))
    async with create_channel(token_stack["decode"].address, TransportSettings()) as shim, \
            create_channel(token_stack["router"].address, TransportSettings()) as router:
        engine, kv = engine_pb2_grpc.EngineStub(shim), engine_pb2_grpc.KVTransferStub(shim)
        generate = router_pb2_grpc.RouterStub(router).Generate
        for i in range(REFUSAL_ROUNDS):
            requests = [_engine_generate(f"r{i}-{j}") for j in range(3)]
            calls = {
                "Engine.Generate iterator": _final_code(engine.Generate(iter(requests), timeout=60)),
                "Engine.Generate write": _final_code(engine.Generate(timeout=60), list(requests)),
                "PushKV": _final_code(kv.PushKV(iter(_push_messages()), timeout=60)),
                "Router.Generate": _final_code(generate(iter([new, new]), timeout=60)),
            }
            for shape, code in zip(calls, await asyncio.gather(*calls.values()), strict=True):
                codes[(shape, code)] += 1
    assert set(codes) == {(shape, "UNAUTHENTICATED") for shape, _ in codes}, codes
