"""The NIXL KV path between two real shim processes (UCX, host memory): it is the default
where NIXL loads and PD through it matches one shim alone; the receiver refuses a write that
quotes another offer or layout, completes a reservation only on the claimed agent's
notification, and fences the pages of a write that breaks off, then frees them; a dead or
stalled receiver ends RemoteSend with a clear code and the sender's pages come back; a
reservation that offers a NIXL write commits no memory to its shared-memory stage. The
receiving and sending checks run twice: with the agent in the shim (a core in a thread) and
in the engine core's own process (`--engine-process on`, nixl_core.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from shim_helpers import (
    PROMPT,
    ShimProcess,
    engine_stub,
    free_pages,
    generate,
    generate_alone,
    greedy,
    introduce,
    logged_path,
    pd_flow,
    start_shim,
    wait_for_free_pages,
)

from engine_shim.backends.embedded.kv_plane.nixl import load_nixl
from microserving.transport import FAULT_METADATA_KEY, FAULT_RECEIVER
from microserving.v1 import engine_pb2, engine_pb2_grpc

NIXL, WHY_NOT = load_nixl()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(NIXL is None, reason=WHY_NOT)]


@pytest.fixture(params=["thread", "process"])
def agent_home(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _shim(request: pytest.FixtureRequest, home: str, role: str) -> ShimProcess:
    if home == "thread":
        return request.getfixturevalue(f"{role}_shim")  # type: ignore[no-any-return]
    shim: ShimProcess = request.getfixturevalue("process_core_shims")[role]
    assert "NIXL agent" in shim.log_text() and "in the engine core process" in shim.log_text()
    return shim


async def _reserve(stub, request_id: str, tokens: list[int]) -> dict:
    prep = await stub.PrepRecv(
        engine_pb2.PrepRecvRequest(request_id=request_id, token_ids=tokens, end=-1, sampling=greedy())
    )
    return json.loads(prep.kv_addr_info)


def _write_request(info: dict, sender_agent: str, **changes: object) -> engine_pb2.WriteKVRequest:
    """A WriteKV claim as a sender builds it (digest from the shim's own KVAddrInfo)."""
    from engine_shim.backends.embedded.kv_plane.addr import KVAddrInfo

    layout = engine_pb2.KVLayout(**info["layout"])
    fields: dict[str, object] = {
        "request_id": info["request_id"],
        "reservation_token": info["reservation_token"],
        "layout": layout,
        "sender_agent": sender_agent,
        "offer_digest": KVAddrInfo.decode(json.dumps(info).encode()).write_digest(),
        "write_deadline_ms": 4000,
    }
    fields.update(changes)
    return engine_pb2.WriteKVRequest(**fields)


async def _no_reservations(stub) -> engine_pb2.GetStatusResponse:
    """D's status once its reservation is gone (an aborted claim's cleanup runs after the
    call ends), or after 5 s."""
    status = await stub.GetStatus(engine_pb2.GetStatusRequest())
    for _ in range(250):
        if status.num_reserved_requests == 0:
            break
        await asyncio.sleep(0.02)
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
    return status


def _kv_stub(channel: grpc.aio.Channel) -> engine_pb2_grpc.KVTransferAsyncStub:
    return engine_pb2_grpc.KVTransferStub(channel)  # type: ignore[return-value]


async def test_pd_through_nixl_is_the_default_and_matches_single_shim(prefill_shim, decode_shim):
    tokens = [10 + (i * 7) % 200 for i in range(300)]  # 19 pages
    expected = await generate_alone(prefill_shim.address, "nixl-alone", tokens)
    ids, prep, sent = await pd_flow(prefill_shim.address, decode_shim.address, "nixl-pd", tokens)
    info = json.loads(prep.kv_addr_info)
    assert info["nixl"]["mem_type"] == "DRAM" and info["nixl"]["agent"]
    assert await logged_path(prefill_shim, "nixl-pd") == "nixl"
    assert sent is not None and sent.num_tokens_sent == 299 - prep.prefix_matched_length
    assert len(expected) == 16 and ids == expected
    # A prompt sharing 12 pages with it: D holds them, only the rest moves (begin > 0).
    longer = tokens[:200] + [t + 3 for t in tokens[200:]]
    expected = await generate_alone(prefill_shim.address, "nixl-alone-2", longer)
    ids, prep, sent = await pd_flow(prefill_shim.address, decode_shim.address, "nixl-pd-2", longer)
    assert prep.prefix_matched_length == 192 and sent is not None
    assert await logged_path(prefill_shim, "nixl-pd-2") == "nixl"
    assert ids == expected


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"offer_digest": "0" * 64}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"reservation_token": "f" * 32}, grpc.StatusCode.NOT_FOUND),
        ({"write_deadline_ms": 0}, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_a_write_claim_that_does_not_match_the_reservation_is_refused(
    decode_shim, change, code
):
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        baseline = await free_pages(stub)
        info = await _reserve(stub, "nixl-refused", [t + 130 for t in PROMPT])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in _kv_stub(channel).WriteKV(_write_request(info, "w", **change)):
                pass
        await stub.Abort(engine_pb2.AbortRequest(request_id="nixl-refused"))
        assert await wait_for_free_pages(stub, baseline, within_s=5) == baseline
    assert refused.value.code() == code


async def test_a_write_claim_of_another_layout_is_failed_precondition(decode_shim):
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        info = await _reserve(stub, "nixl-layout", [t + 131 for t in PROMPT])
        layout = engine_pb2.KVLayout(**{**info["layout"], "head_dim": 7})
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in _kv_stub(channel).WriteKV(_write_request(info, "w", layout=layout)):
                    pass
        finally:
            await stub.Abort(engine_pb2.AbortRequest(request_id="nixl-layout"))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_only_the_claimed_agents_notification_completes_the_reservation(
    request: pytest.FixtureRequest, agent_home: str
):
    """The test is the sender: two agents of its own load D's metadata; the one not named in
    the claim notifies first and completes nothing, then the claimed one does."""
    decode_shim = _shim(request, agent_home, "decode")
    claimed = NIXL.nixl_agent(f"test-claimed-{secrets.token_hex(3)}")
    stranger = NIXL.nixl_agent(f"test-stranger-{secrets.token_hex(3)}")
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        baseline = await free_pages(stub)
        tokens = [t + 132 for t in PROMPT]
        info = await _reserve(stub, "nixl-notif", tokens)
        metadata = base64.b64decode(info["nixl"]["metadata"])
        for agent in (claimed, stranger):
            assert agent.add_remote_agent(metadata).decode() == info["nixl"]["agent"]
        call = _kv_stub(channel).WriteKV(_write_request(info, claimed.name))
        assert (await call.read()).WhichOneof("event") == "ready"
        stranger.send_notif(info["nixl"]["agent"], info["reservation_token"].encode())
        read = asyncio.ensure_future(call.read())
        done, _ = await asyncio.wait({read}, timeout=1.0)
        assert not done  # a stranger's notification completes nothing
        claimed.send_notif(info["nixl"]["agent"], info["reservation_token"].encode())
        event = await asyncio.wait_for(read, timeout=30)
        assert event.WhichOneof("event") == "done"
        assert event.done.num_tokens_written == len(tokens) - 1
        # Completed: D now generates over the window (the KV is whatever the pool held).
        assert len(await generate(stub, "nixl-notif", tokens, begin=len(tokens) - 1)) == 16
        assert await wait_for_free_pages(stub, baseline, within_s=5) == baseline


async def test_a_write_that_breaks_off_after_ready_fences_its_pages_then_frees_them(
    request: pytest.FixtureRequest, agent_home: str
):
    decode_shim = _shim(request, agent_home, "decode")
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        baseline = await free_pages(stub)
        info = await _reserve(stub, "nixl-broken", [t + 133 for t in PROMPT])
        reserved = await free_pages(stub)
        call = _kv_stub(channel).WriteKV(
            _write_request(info, "gone-writer", write_deadline_ms=4000)
        )
        assert (await call.read()).WhichOneof("event") == "ready"
        call.cancel()  # the sender vanished mid-write
        status = await _no_reservations(stub)
        # The reservation is gone, but its pages are fenced: a late write may still land.
        assert status.num_reserved_requests == 0
        assert status.num_free_kv_pages == reserved < baseline
        # After the writer's deadline (4 s) and the margin, they are free again.
        assert await wait_for_free_pages(stub, baseline, within_s=30) == baseline


async def test_an_abandoned_claim_leaves_the_reservation_open_and_unfenced(
    request: pytest.FixtureRequest, agent_home: str
):
    """A sender claims while its engine computes; when it gives up before writing it says so
    (AbandonKVWrite): the receiver ends the claim's call without `done`, keeps the
    reservation open for another claim, and an abort then frees the pages at once, where a
    claim broken off without a word fences them until its deadline (a minute here)."""
    decode_shim = _shim(request, agent_home, "decode")
    channel, stub = engine_stub(decode_shim.address)
    kv = _kv_stub(channel)
    async with channel:
        baseline = await free_pages(stub)
        info = await _reserve(stub, "nixl-abandon", [t + 137 for t in PROMPT])

        def abandon(agent: str) -> engine_pb2.AbandonKVWriteRequest:
            return engine_pb2.AbandonKVWriteRequest(
                request_id=info["request_id"], reservation_token=info["reservation_token"],
                sender_agent=agent,
            )

        for writer in ("early-writer", "second-writer"):
            call = kv.WriteKV(_write_request(info, writer, write_deadline_ms=60_000))
            assert (await call.read()).WhichOneof("event") == "ready"
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await kv.AbandonKVWrite(abandon("someone-else"))  # only the claimant may
            assert wrong.value.code() == grpc.StatusCode.NOT_FOUND
            await kv.AbandonKVWrite(abandon(writer))
            assert await asyncio.wait_for(call.read(), timeout=10) is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
            status = await stub.GetStatus(engine_pb2.GetStatusRequest())
            assert status.num_reserved_requests == 1  # open again, for the next claim
        await stub.Abort(engine_pb2.AbortRequest(request_id=info["request_id"]))
        assert await wait_for_free_pages(stub, baseline, within_s=10) == baseline


def _core_pid(shim: ShimProcess) -> int:
    """The engine core's process of a shim started with --engine-process on."""
    import psutil

    cores = [child.pid for child in psutil.Process(shim.process.pid).children()
             if "spawn_main" in " ".join(child.cmdline())]
    assert len(cores) == 1, cores
    return cores[0]


async def _claim_with_the_core_stopped(
    decode_shim: ShimProcess, request_id: str, tokens: list[int], writer: str, *, hold: bool
) -> None:
    """Reserve (and, with `hold`, open a HoldKV the engine confirms), stop D's engine core,
    claim: the claim's `ready` must come while the core is stopped; then the sender vanishes
    mid-write, and the write it had begun still reached the engine before the abort that
    follows: the pages are fenced, then freed."""
    core_pid = _core_pid(decode_shim)
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        baseline = await free_pages(stub)
        info = await _reserve(stub, request_id, tokens)
        reserved = await free_pages(stub)
        held = None
        if hold:
            held = _kv_stub(channel).HoldKV(engine_pb2.HoldKVRequest(
                request_id=info["request_id"], reservation_token=info["reservation_token"]))
            assert (await held.read()).WhichOneof("event") == "held"
        os.kill(core_pid, signal.SIGSTOP)
        try:
            call = _kv_stub(channel).WriteKV(_write_request(info, writer, write_deadline_ms=3000))
            event = await asyncio.wait_for(call.read(), timeout=5)
        finally:
            os.kill(core_pid, signal.SIGCONT)
        assert event.WhichOneof("event") == "ready"
        call.cancel()  # the sender vanished mid-write
        if held is not None:
            held.cancel()
        status = await _no_reservations(stub)
        assert status.num_reserved_requests == 0
        assert status.num_free_kv_pages == reserved < baseline  # fenced: the write had begun
        assert await wait_for_free_pages(stub, baseline, within_s=30) == baseline


async def test_a_claim_under_a_confirmed_hold_goes_ahead_without_the_engine(process_core_shims):
    """With a HoldKV open, the engine's reservation cannot expire: the claim's `ready` comes
    while the engine core is stopped (under load it would wait for a whole step)."""
    await _claim_with_the_core_stopped(process_core_shims["decode"], "nixl-held-claim",
                                       [t + 136 for t in PROMPT], "held-writer", hold=True)


async def test_a_claim_goes_ahead_without_the_engine_where_the_shim_owns_the_ttl(process_core_shims):
    """A receiver that offers NIXL writes reserves with no TTL in its engine (its shim's is
    the only one, and ends the engine's reservation when it passes): so a claim's `ready`
    comes with no HoldKV at all while the engine core is stopped."""
    await _claim_with_the_core_stopped(process_core_shims["decode"], "nixl-ttl-owned-claim",
                                       [t + 142 for t in PROMPT], "ttl-owned-writer", hold=False)


@pytest.fixture()
def lone_receiver(tmp_path: Path) -> Iterator[ShimProcess]:
    shim = start_shim(tmp_path, "lone-d", "--role", "decode")
    yield shim
    if shim.process.poll() is None:
        os.kill(shim.process.pid, signal.SIGCONT)
    shim.stop()


async def test_a_stalled_then_dead_receiver_ends_remote_send_with_a_clear_code(
    request: pytest.FixtureRequest, agent_home: str, lone_receiver
):
    prefill_shim = _shim(request, agent_home, "prefill")
    d_channel, d_stub = engine_stub(lone_receiver.address)
    p_channel, p_stub = engine_stub(prefill_shim.address)
    async with d_channel, p_channel:
        await introduce(p_stub, lone_receiver.address)  # a shim writes KV to known peers only
        baseline = await free_pages(p_stub)
        codes = []
        # The stalled receiver never answers, so its send ends at the caller's deadline (kept
        # short); the dead one must end well within its deadline, by the sender's own means.
        for request_id, stop, deadline_s in (("nixl-stalled", signal.SIGSTOP, 3.0),
                                             ("nixl-dead", signal.SIGKILL, 8.0)):
            tokens = [t + (134 if stop == signal.SIGSTOP else 135) for t in PROMPT]
            prep = await d_stub.PrepRecv(
                engine_pb2.PrepRecvRequest(
                    request_id=request_id, token_ids=tokens, end=-1, sampling=greedy()
                )
            )
            os.kill(lone_receiver.process.pid, stop)
            send = engine_pb2.RemoteSendRequest(
                request_id=request_id, token_ids=tokens, begin=0, end=prep.end,
                kv_addr_info=prep.kv_addr_info, sampling=greedy(),
            )
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await p_stub.RemoteSend(send, timeout=deadline_s)
            codes.append((failed.value.code(), time.monotonic() - started,
                          dict(failed.value.trailing_metadata() or ())))
            if stop == signal.SIGSTOP:
                os.kill(lone_receiver.process.pid, signal.SIGCONT)
            # The sender's pages (the send's own) come back either way.
            assert await wait_for_free_pages(p_stub, baseline, within_s=10) == baseline
    stalled, dead = codes
    assert stalled[0] in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    assert dead[0] == grpc.StatusCode.UNAVAILABLE and dead[1] < 8.0
    # The sender says whose fault it is, so a router takes the receiver out of rotation.
    assert dead[2].get(FAULT_METADATA_KEY) == FAULT_RECEIVER


async def test_write_kv_on_a_shim_without_nixl_is_invalid(tmp_path: Path):
    shim = start_shim(tmp_path, "grpc-only", "--kv-transport", "grpc")
    try:
        channel, stub = engine_stub(shim.address)
        async with channel:
            info = await _reserve(stub, "no-nixl", [t + 136 for t in PROMPT])
            assert "nixl" not in info and "shm" not in info
            info["nixl"] = None
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in _kv_stub(channel).WriteKV(_write_request(info, "w")):
                    pass
            await stub.Abort(engine_pb2.AbortRequest(request_id="no-nixl"))
    finally:
        shim.stop()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _allocated_bytes(pid: int, fd: int) -> int:
    return os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512


async def test_a_reservation_offering_a_nixl_write_stages_no_memory_up_front(tmp_path: Path):
    """Its shared-memory stage (for a sender without NIXL) is leased unbacked; a receiver
    that offers no NIXL write backs its stage at once, so a lack of memory shows at the lease."""
    shims = {name: start_shim(tmp_path, name, *args) for name, args in
             (("nixl-d", ()), ("shm-d", ("--kv-transport", "shm")))}
    try:
        allocated = {}
        for name, shim in shims.items():
            channel, stub = engine_stub(shim.address)
            async with channel:
                info = await _reserve(stub, f"{name}-r", [t + 140 for t in PROMPT])
                assert ("nixl" in info) == (name == "nixl-d") and "shm" in info
                allocated[name] = _allocated_bytes(shim.process.pid, info["shm"]["fd"])
                size = info["shm"]["size"]
                await stub.Abort(engine_pb2.AbortRequest(request_id=f"{name}-r"))
        assert allocated["nixl-d"] <= 4096  # the nonce's page at most
        assert allocated["shm-d"] >= size
    finally:
        for shim in shims.values():
            shim.stop()
