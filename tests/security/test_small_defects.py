"""The small defects found by the hostile-caller review, each pinned: a deeply nested
kv_addr_info is INVALID_ARGUMENT (not INTERNAL from a RecursionError); a push refused by the
receiver keeps its NOT_FOUND (not INTERNAL, and no `aclose(): asynchronous generator is
already running` in the log)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from stack_procs import (
    Service,
    engine_status,
    greedy,
    pages_at_baseline,
    start_router,
    start_shims,
    stop_all,
)

from engine_shim.backends.embedded.kv_plane.addr import KVAddrInfo
from engine_shim.engine.api import InvalidRequestError
from microserving.transport import TransportSettings, create_channel
from microserving.v1 import engine_pb2, engine_pb2_grpc

PROMPT = list(range(10, 60))


def test_deeply_nested_kv_addr_info_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidRequestError, match="nested too deeply"):
        KVAddrInfo.decode(b"[" * 100_000 + b"]" * 100_000)


@pytest.fixture(scope="module")
def shims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("defects")
    prefill, decode = start_shims(logs, ["prefill", "decode"])
    # A router registers both, so each shim knows the other as a KV peer.
    router = start_router(logs, [f"{prefill.address}=prefill", f"{decode.address}=decode"])
    services = {"prefill": prefill, "decode": decode, "router": router}
    yield services
    stop_all(services.values())


@pytest.mark.e2e
async def test_a_push_the_receiver_refuses_keeps_its_not_found(shims: dict[str, Service]) -> None:
    prefill, decode = shims["prefill"], shims["decode"]
    async with create_channel(decode.address, TransportSettings()) as channel:
        reply = await engine_pb2_grpc.EngineStub(channel).PrepRecv(
            engine_pb2.PrepRecvRequest(request_id="bad-token", token_ids=PROMPT, end=-1, sampling=greedy(4)),
            timeout=30)
    addr = json.loads(reply.kv_addr_info)
    addr["reservation_token"] = "0" * 32  # not the reservation's token: the receiver refuses
    request = engine_pb2.RemoteSendRequest(request_id="bad-token", token_ids=PROMPT, begin=0, end=-1,
                                           kv_addr_info=json.dumps(addr).encode(), sampling=greedy(4))
    baseline = (await engine_status(prefill.address)).num_free_kv_pages
    async with create_channel(prefill.address, TransportSettings()) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RemoteSend(request, timeout=60)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND, caught.value.details()
    assert await pages_at_baseline([prefill.address], [baseline], within_s=10) == [baseline]
    assert "already running" not in prefill.log()
    assert "Traceback" not in prefill.log()
