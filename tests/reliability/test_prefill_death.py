"""Prefill death during RemoteSend: the prefill shim is frozen while the router's RemoteSend
is outstanding (the decode shim holds the PrepRecv reservation), then killed with SIGKILL.
The router aborts the parked reservation on the decode side and retries the request (the
decode engine alone, as no prefill engine is left); the answer equals the no-fault
reference and the decode shim ends with no reservation and its free pages at baseline."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest
from stack_procs import (
    Service,
    Tracked,
    engine_status,
    greedy,
    pages_at_baseline,
    router_status,
    start_router,
    start_shims,
    stop_all,
    track,
    wait_until,
)

from microserving.tokenizer import Tokenizer
from microserving.transport import TransportSettings, create_channel
from microserving.v1 import engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.e2e

PROMPT = "a prompt long enough to span several KV pages of sixteen tokens each, " * 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("prefill-death")
    # The KV peers the router tells P outlive the test: with its polls a minute apart, a told
    # peer lasting the default minute could lapse just before the next poll renewed it.
    prefill, decode = start_shims(logs, ["prefill", "decode"], "--kv-peer-ttl-s", "3600")
    router = start_router(logs, [f"{prefill.address}=prefill", f"{decode.address}=decode"],
                          "--pattern", "disagg", "--health-interval-s", "60")
    services = {"prefill": prefill, "decode": decode, "router": router}
    yield services
    stop_all(services.values())


async def _alone(address: str, token_ids: list[int]) -> list[int]:
    """The reference: StartGenerate from position 0 on one engine (the prefill one, so the
    decode engine's prefix cache stays empty and the router must really call RemoteSend)."""
    async with create_channel(address, TransportSettings()) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        request = engine_pb2.StartGenerateRequest(request_id="reference", token_ids=token_ids, sampling=greedy(8))
        return [t async for m in stub.StartGenerate(request, timeout=60) for c in m.choices for t in c.token_ids]


async def test_prefill_killed_during_remote_send_frees_the_reservation_and_retries(stack) -> None:
    prefill, decode, router = stack["prefill"], stack["decode"], stack["router"]
    token_ids = Tokenizer.from_model("tiny").encode(PROMPT)
    want = await _alone(prefill.address, token_ids)
    baseline = (await engine_status(decode.address)).num_free_kv_pages

    prefill.pause()
    async with create_channel(router.address, TransportSettings()) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        record = Tracked("pd", [])
        request = router_pb2.NewRequest(request_id="pd", token_ids=router_pb2.TokenIds(ids=token_ids),
                                        sampling=greedy(8))
        task = asyncio.ensure_future(track(stub, request, record))

        async def parked_in_remote_send() -> bool:
            engines = {e.address: e for e in (await router_status(router.address)).engines}
            reserved = (await engine_status(decode.address)).num_reserved_requests
            return reserved == 1 and engines[prefill.address].num_inflight_prefill == 1

        assert await wait_until(parked_in_remote_send, 30) is not None
        prefill.kill()
        await asyncio.wait_for(task, timeout=60)

    assert record.error is None and not record.rpc_error, (record.error, record.rpc_error)
    assert record.token_ids == want
    assert record.done is not None and list(record.done.engines) == [decode.address]
    assert re.search(r"retrying pd elsewhere after remote_send on " + re.escape(prefill.address), router.log())
    status = await engine_status(decode.address)
    assert status.num_reserved_requests == 0
    assert await pages_at_baseline([decode.address], [baseline]) == [baseline]
