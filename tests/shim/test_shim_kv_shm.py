"""The same-host shared-memory KV path between two real shim processes: PD carries the tokens
exactly through it (P logs path=shm-stream: the push went on the receiver's PushKVStream; P runs with --kv-transport shm, since the default
prefers NIXL where it loads), either side with --kv-shm false falls back to the gRPC stream, the receiver still refuses a mismatched layout before staged KV lands in its pool, a
push that breaks off frees its pages and retires its segment, and segments are memfds that
leave no name in /dev/shm, before or after their shim stops."""

from __future__ import annotations

import asyncio
import json
import os
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
    pd_flow,
    reserve,
    stage_ones,
    start_shim,
    wait_for_free_pages,
)

from engine_shim.backends.embedded.kv_plane.shm import (
    RETIRED_CHECK_S,
    host_identity,
    stage_fds,
)
from microserving.transport import TransportSettings, create_channel
from microserving.v1 import engine_pb2, engine_pb2_grpc

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(host_identity() is None, reason="needs memfd and /proc (Linux)"),
]


@pytest.fixture(scope="module")
def shm_off_shim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShimProcess]:
    shim = start_shim(
        tmp_path_factory.mktemp("shm-off"), "shm-off", "--kv-shm", "false", "--kv-transport", "shm"
    )
    yield shim
    shim.stop()


@pytest.fixture(scope="module")
def shm_prefill_shim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShimProcess]:
    """A sender that uses shared memory where offered (not NIXL)."""
    shim = start_shim(tmp_path_factory.mktemp("shm-p"), "shm-p", "--kv-transport", "shm")
    yield shim
    shim.stop()


async def _pd(
    p: ShimProcess, d: ShimProcess, request_id: str, tokens: list[int]
) -> tuple[list[int], dict]:
    """The PD flow; the tokens and D's kv_addr_info."""
    ids, prep, _ = await pd_flow(p.address, d.address, request_id, tokens)
    return ids, json.loads(prep.kv_addr_info)


async def _logged_path(shim: ShimProcess, request_id: str) -> str:
    """The path= P logged for `request_id`'s RemoteSend ("" if none yet)."""
    for _ in range(50):  # the line reaches the file right after the call returns
        for line in shim.log_text().splitlines():
            if f"RemoteSend {request_id}:" in line:
                return line.rsplit("path=", 1)[1].strip()
        await asyncio.sleep(0.02)
    return ""


async def test_pd_through_shared_memory_matches_single_shim(shm_prefill_shim, decode_shim):
    tokens = [t + 120 for t in PROMPT]
    expected = await generate_alone(shm_prefill_shim.address, "shm-alone", tokens)
    ids, info = await _pd(shm_prefill_shim, decode_shim, "shm-pd", tokens)
    assert info["shm"]["host"] == host_identity()
    assert info["shm"]["pid"] == decode_shim.process.pid
    assert info["shm"]["fd"] in stage_fds(decode_shim.process.pid)
    assert await _logged_path(shm_prefill_shim, "shm-pd") == "shm-stream"
    assert len(expected) == 16 and ids == expected


async def test_a_sender_with_shared_memory_off_pushes_over_grpc(shm_off_shim, decode_shim):
    tokens = [t + 121 for t in PROMPT]
    expected = await generate_alone(shm_off_shim.address, "off-p-alone", tokens)
    ids, info = await _pd(shm_off_shim, decode_shim, "off-p-pd", tokens)
    assert "shm" in info  # offered, but this sender does not use it
    assert await _logged_path(shm_off_shim, "off-p-pd") == "grpc"
    assert ids == expected


async def test_a_receiver_with_shared_memory_off_offers_none_and_gets_grpc(
    prefill_shim, shm_off_shim
):
    tokens = [t + 122 for t in PROMPT]
    expected = await generate_alone(prefill_shim.address, "off-d-alone", tokens)
    ids, info = await _pd(prefill_shim, shm_off_shim, "off-d-pd", tokens)
    assert "shm" not in info
    assert await _logged_path(prefill_shim, "off-d-pd") == "grpc"
    assert ids == expected


# ---- the receiver's guarantees, with the test as the sender ----


def _header(info: dict, **layout_changes: object) -> engine_pb2.PushKVRequest:
    layout = engine_pb2.KVLayout(**{**info["layout"], **layout_changes})
    return engine_pb2.PushKVRequest(
        header=engine_pb2.KVPushHeader(
            request_id=info["request_id"],
            reservation_token=info["reservation_token"],
            layout=layout,
        )
    )


def _windowless_chunk(begin: int, num_tokens: int) -> engine_pb2.PushKVRequest:
    """A chunk that names its window only: its KV is in the receiver's stage."""
    return engine_pb2.PushKVRequest(
        chunk=engine_pb2.KVChunkData(begin=begin, num_tokens=num_tokens)
    )


async def _push(address: str, messages: list[engine_pb2.PushKVRequest]) -> None:
    async with create_channel(address, TransportSettings()) as channel:
        await engine_pb2_grpc.KVTransferStub(channel).PushKV(iter(messages))


async def test_a_mismatched_layout_is_refused_before_staged_kv_lands(decode_shim):
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        tokens = [t + 123 for t in PROMPT]
        end, info = await reserve(stub, "shm-mismatch", tokens)
        stage_ones(info, end)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _push(
                    decode_shim.address,
                    [_header(info, model_fingerprint="other"), _windowless_chunk(0, end)],
                )
            # Nothing was imported: generating over the window is refused.
            with pytest.raises(grpc.aio.AioRpcError) as not_imported:
                await generate(stub, "shm-mismatch", tokens, begin=end)
        finally:
            await stub.Abort(engine_pb2.AbortRequest(request_id="shm-mismatch"))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not_imported.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not been fully imported" in (not_imported.value.details() or "")


async def test_a_windowless_chunk_without_a_stage_is_invalid(shm_off_shim):
    channel, stub = engine_stub(shm_off_shim.address)
    async with channel:
        baseline = await free_pages(stub)
        end, info = await reserve(stub, "no-stage", [t + 124 for t in PROMPT])
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _push(shm_off_shim.address, [_header(info), _windowless_chunk(0, end)])
        assert await wait_for_free_pages(stub, baseline) == baseline
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_shared_memory_push_that_breaks_off_frees_pages_and_retires_its_segment(
    decode_shim,
):
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        baseline = await free_pages(stub)
        _, info = await reserve(stub, "shm-broken", [t + 125 for t in PROMPT])
        stage_ones(info, 16)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _push(decode_shim.address, [_header(info), _windowless_chunk(0, 16)])
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # ended short
        assert await wait_for_free_pages(stub, baseline) == baseline
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
        assert status.num_reserved_requests == 0
    # A sender might still write it, so the segment is closed, never leased again.
    assert info["shm"]["fd"] not in stage_fds(decode_shim.process.pid)


# ---- segment lifetime ----


def _names_in_dev_shm() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("microserving*"))


def _stage_inodes(pid: int) -> set[int]:
    return {os.stat(f"/proc/{pid}/fd/{fd}").st_ino for fd in stage_fds(pid)}


async def test_stages_leave_no_name_in_dev_shm_and_no_mapping_past_their_shim(
    shm_prefill_shim, decode_shim, tmp_path: Path
):
    before = _names_in_dev_shm()
    receiver = start_shim(tmp_path, "receiver")
    try:
        _, info = await _pd(shm_prefill_shim, receiver, "lifetime-pd", [t + 126 for t in PROMPT])
        assert await _logged_path(shm_prefill_shim, "lifetime-pd") == "shm-stream"
        stage = os.stat(f"/proc/{receiver.process.pid}/fd/{info['shm']['fd']}").st_ino
        assert stage in _stage_inodes(shm_prefill_shim.process.pid)  # P keeps it mapped for reuse
        assert _names_in_dev_shm() == before  # memfds: nothing named that could leak
    finally:
        assert receiver.stop() == 0  # SIGTERM: drained and stopped cleanly
    # P lets go of the gone receiver's segment at its first push (to another receiver) once
    # its periodic look for closed segments is due.
    await asyncio.sleep(RETIRED_CHECK_S * 1.1)
    await _pd(shm_prefill_shim, decode_shim, "after-lifetime", [t + 127 for t in PROMPT])
    assert await _logged_path(shm_prefill_shim, "after-lifetime") == "shm-stream"
    assert stage not in _stage_inodes(shm_prefill_shim.process.pid)
    assert _names_in_dev_shm() == before
