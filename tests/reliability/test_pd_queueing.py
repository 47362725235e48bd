"""PD under queueing: a PrepRecv reservation does not expire while its RemoteSend waits in the
prefill engine's queue (on every transport the sender reaches the receiver before its engine
computes the KV: a PushKV is opened then, a NIXL write opens a HoldKV then; the receiver holds
the reservation while either is open), and a PD hand-off that fails anyway (the prefill
engine stalled longer than the TTL before it even began the push) is retried or falls back
to the decode engine: the client gets its tokens or a 503-class error, never NOT_FOUND
(HTTP 404 model_not_found) and never an engine's address."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from stack_procs import (
    Service,
    Tracked,
    engine_status,
    greedy,
    start_router,
    start_shims,
    stop_all,
    track,
    wait_until,
)

from engine_shim.backends.embedded.kv_plane.nixl import load_nixl
from microserving.transport import TransportSettings, create_channel
from microserving.v1 import engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.e2e

TTL_S = 0.5
LONG_BLOCKER_TOKENS = 1800  # longer than any test waits: ended by cancelling it


def _pd_stack(logs: Path, *prefill_args: str) -> Iterator[dict[str, Service]]:
    """P running one sequence at a time (a send job queues behind whatever P is running),
    D with a TTL of TTL_S, and a disagg router over them."""
    (prefill,) = start_shims(logs, ["prefill"], "--max-num-seqs", "1", *prefill_args, prefix="p")
    (decode,) = start_shims(logs, ["decode"], "--reservation-ttl-s", str(TTL_S), prefix="d")
    router = start_router(logs, [f"{prefill.address}=prefill", f"{decode.address}=decode"],
                          "--pattern", "disagg", "--health-interval-s", "0.2")
    services = {"prefill": prefill, "decode": decode, "router": router}
    yield services
    stop_all(services.values())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    # P sends on its default transport (NIXL where it loads, else shared memory or
    # KVTransfer): each holds the decode side's reservation from the moment the send begins,
    # before P queues.
    yield from _pd_stack(tmp_path_factory.mktemp("pd-queueing"))


async def _occupy(address: str, request_id: str, num_tokens: int) -> int:
    """A long generation straight on the engine; -> tokens it produced."""
    request = engine_pb2.StartGenerateRequest(request_id=request_id, token_ids=[5, 6, 7],
                                              sampling=greedy(num_tokens))
    produced = 0
    async with create_channel(address, TransportSettings()) as channel:
        async for reply in engine_pb2_grpc.EngineStub(channel).StartGenerate(request, timeout=120):
            produced += sum(len(c.token_ids) for c in reply.choices)
    return produced


async def _send(router: Service, request_id: str, prompt: list[int]) -> Tracked:
    async with create_channel(router.address, TransportSettings()) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        new = router_pb2.NewRequest(request_id=request_id, token_ids=router_pb2.TokenIds(ids=prompt),
                                    sampling=greedy(8))
        return await track(stub, new, Tracked(request_id, []))


async def _wait_waiting(address: str, num_waiting: int = 1) -> None:
    async def is_waiting() -> bool:
        return (await engine_status(address)).num_waiting_requests >= num_waiting

    assert await wait_until(is_waiting, timeout_s=60) is not None


async def _wait_running(address: str) -> None:
    async def is_running() -> bool:
        return (await engine_status(address)).num_running_requests > 0

    assert await wait_until(is_running, timeout_s=30) is not None


async def test_reservation_outlives_a_prefill_queue_longer_than_its_ttl(stack: dict[str, Service]) -> None:
    prefill, decode = stack["prefill"], stack["decode"]
    # P runs one sequence at a time: a generation longer than the test holds it until the
    # queued send has waited past D's TTL on P (seen in P's status, then timed here, so no
    # machine speed decides whether the send waited long enough); then it is cancelled.
    blocker = asyncio.ensure_future(_occupy(prefill.address, "blocker", LONG_BLOCKER_TOKENS))
    await _wait_running(prefill.address)
    sent = asyncio.ensure_future(_send(stack["router"], "queued", list(range(20, 120))))
    await _wait_waiting(prefill.address)
    await asyncio.sleep(TTL_S * 2)
    assert not blocker.done()
    blocker.cancel()  # its call ends, P aborts it and runs the queued send
    record = await sent
    assert record.error is None and not record.rpc_error, (record.error, record.rpc_error)
    assert record.done is not None and len(record.token_ids) == 8
    # The KV came from P: the router did not have to fall back to D alone.
    assert set(record.done.engines) == {prefill.address, decode.address}, record.done.engines
    if load_nixl()[0] is not None:  # the default transport where NIXL loads: the send
        line = await _remote_send_line(prefill)  # waited in P's queue longer than D's TTL
        assert line.endswith("path=nixl") and _hold_ms(line) > TTL_S * 1e3, line


async def _remote_send_line(prefill: Service) -> str:
    """P's log line of the last RemoteSend it finished (written right after the call)."""
    def lines() -> list[str]:
        return [text for text in prefill.log().splitlines() if " RemoteSend " in text]

    async def is_logged() -> bool:
        return bool(lines())

    await wait_until(is_logged, timeout_s=10)
    return (lines() or [""])[-1]


def _hold_ms(line: str) -> float:
    """How long the NIXL sender waited for its engine (queue + prefill), from its log line."""
    found = re.search(r"\(hold ([0-9.]+)", line)
    assert found is not None, line
    return float(found.group(1))


async def test_prefill_stalled_past_the_ttl_ends_in_tokens_or_503_never_404(stack: dict[str, Service]) -> None:
    """P paused (SIGSTOP) with RemoteSends on it for longer than D's TTL: when it wakes, the
    pushes find their reservations gone; the router tries again or serves from D alone."""
    prefill = stack["prefill"]
    prefill.pause()
    try:
        sends = [asyncio.ensure_future(_send(stack["router"], f"stalled-{i}", list(range(30 + i, 130 + i))))
                 for i in range(4)]
        await asyncio.sleep(TTL_S * 6)
    finally:
        prefill.resume()
    records = await asyncio.gather(*sends)
    for record in records:
        assert not record.rpc_error, record.rpc_error
        if record.error is not None:
            code = grpc.StatusCode.UNAVAILABLE.value[0], grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert record.error.code in code, record.error
            assert prefill.address not in record.error.message
            assert stack["decode"].address not in record.error.message
        else:
            assert record.done is not None and len(record.token_ids) == 8


async def test_expired_reservations_leave_the_engine_status_without_another_command(
    stack: dict[str, Service]
) -> None:
    decode = stack["decode"]
    async with create_channel(decode.address, TransportSettings()) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        await stub.PrepRecv(engine_pb2.PrepRecvRequest(request_id="never-followed", token_ids=list(range(40)),
                                                       end=-1, sampling=greedy(4)), timeout=30)

    async def is_reaped() -> bool:
        return (await engine_status(decode.address)).num_reserved_requests == 0

    assert await wait_until(is_reaped, timeout_s=TTL_S + 10) is not None


async def test_a_hold_keeps_a_reservation_past_its_ttl_until_the_hold_ends(stack: dict[str, Service]) -> None:
    """KVTransfer.HoldKV (what a NIXL sender opens as its RemoteSend begins): while it is open
    the reservation and its pages outlive the TTL; once it ends, the TTL reclaims them."""
    decode = stack["decode"]
    baseline = (await engine_status(decode.address)).num_free_kv_pages
    async with create_channel(decode.address, TransportSettings()) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        prep = await stub.PrepRecv(engine_pb2.PrepRecvRequest(
            request_id="held", token_ids=[7 + i % 250 for i in range(64)], end=-1, sampling=greedy(4)), timeout=30)
        token = json.loads(prep.kv_addr_info)["reservation_token"]
        kv = engine_pb2_grpc.KVTransferStub(channel)
        wrong = kv.HoldKV(engine_pb2.HoldKVRequest(request_id="held", reservation_token="0" * 32))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await wrong.read()
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        hold = kv.HoldKV(engine_pb2.HoldKVRequest(request_id="held", reservation_token=token))
        assert (await hold.read()).WhichOneof("event") == "held"
        await asyncio.sleep(TTL_S * 6)  # a reaper would have run several times
        status = await engine_status(decode.address)
        assert status.num_reserved_requests == 1 and status.num_free_kv_pages < baseline
        hold.cancel()

    async def is_reclaimed() -> bool:
        status = await engine_status(decode.address)
        return status.num_reserved_requests == 0 and status.num_free_kv_pages == baseline

    assert await wait_until(is_reclaimed, timeout_s=TTL_S + 10) is not None


WRITE_TIMEOUT_S = 2.0  # the claim is given up half of it (1 s) before its deadline


@pytest.fixture(scope="module")
def core_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    """As `stack`, with P's engine core in a process of its own (as on a GPU): its NIXL agent
    sits beside the core, so P claims D's reservation as each send begins, and a claim's
    deadline (2 s here) can pass while the send still queues."""
    module, reason = load_nixl()
    if module is None:
        pytest.skip(f"NIXL does not load here: {reason}")
    yield from _pd_stack(tmp_path_factory.mktemp("pd-queueing-core"), "--engine-process", "on",
                         "--kv-write-timeout-s", str(WRITE_TIMEOUT_S))


async def test_a_send_queued_past_its_claims_deadline_keeps_the_reservation(
    core_stack: dict[str, Service]
) -> None:
    """The early claim holds D's reservation while it is open; when its deadline passes with
    the send still in P's queue, P opens a HoldKV before abandoning the claim, so the
    reservation outlives the queue (longer than the claim's deadline and D's TTL together),
    and P claims again once the KV is computed."""
    prefill, decode = core_stack["prefill"], core_stack["decode"]
    # Two long generations ahead of the send (a core of its own decodes one in a few seconds,
    # so one might end before the send has waited long enough); cancelled after the wait.
    blockers = [asyncio.ensure_future(_occupy(prefill.address, "blocker", LONG_BLOCKER_TOKENS))]
    await _wait_running(prefill.address)
    blockers.append(asyncio.ensure_future(_occupy(prefill.address, "blocker-2", LONG_BLOCKER_TOKENS)))
    await _wait_waiting(prefill.address)
    sent = asyncio.ensure_future(_send(core_stack["router"], "queued-early", list(range(20, 120))))
    await _wait_waiting(prefill.address, 2)
    await asyncio.sleep(WRITE_TIMEOUT_S + TTL_S * 2)
    for blocker in blockers:
        blocker.cancel()
    record = await sent
    assert record.error is None and not record.rpc_error, (record.error, record.rpc_error)
    assert record.done is not None and len(record.token_ids) == 8
    assert set(record.done.engines) == {prefill.address, decode.address}, record.done.engines
    line = await _remote_send_line(prefill)
    assert line.endswith("path=nixl") and _hold_ms(line) > (WRITE_TIMEOUT_S + TTL_S) * 1e3, line
