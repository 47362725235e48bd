"""The embedded shims' KV data plane: kv_addr_info is self-describing, a receiver refuses KV
of another layout (FAILED_PRECONDITION) or with a wrong reservation token (NOT_FOUND), and a
push that breaks off leaves nothing reserved."""

from __future__ import annotations

import json

import grpc
import pytest
from shim_helpers import PROMPT, engine_stub, free_pages, greedy, introduce, wait_for_free_pages

from microserving.transport import TransportSettings, create_channel
from microserving.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.e2e


async def _reserve(
    stub, request_id: str, tokens: list[int]
) -> tuple[engine_pb2.PrepRecvResponse, dict]:
    prep = await stub.PrepRecv(
        engine_pb2.PrepRecvRequest(
            request_id=request_id, token_ids=tokens, end=-1, sampling=greedy()
        )
    )
    return prep, json.loads(prep.kv_addr_info)


async def _push(
    address: str, messages: list[engine_pb2.PushKVRequest]
) -> engine_pb2.PushKVResponse:
    async with create_channel(address, TransportSettings()) as channel:
        return await engine_pb2_grpc.KVTransferStub(channel).PushKV(iter(messages))


def _header(info: dict, **layout_changes: object) -> engine_pb2.PushKVRequest:
    layout = engine_pb2.KVLayout(**{**info["layout"], **layout_changes})
    header = engine_pb2.KVPushHeader(
        request_id=info["request_id"], reservation_token=info["reservation_token"], layout=layout
    )
    return engine_pb2.PushKVRequest(header=header)


async def test_kv_addr_info_describes_address_slots_and_layout(decode_shim):
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        tokens = [t + 11 for t in PROMPT]
        prep, info = await _reserve(stub, "describe", tokens)
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
        await stub.Abort(engine_pb2.AbortRequest(request_id="describe"))
    assert info["address"] == decode_shim.address and info["request_id"] == "describe"
    assert info["layout"]["model_fingerprint"] == status.kv_layout.model_fingerprint
    assert info["layout"]["page_size"] == status.kv_layout.page_size
    segments = info["kv_segments"]
    assert (
        segments[0] * 2 + 1 == len(segments)
        and sum(segments[2::2]) == prep.end - prep.prefix_matched_length
    )


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "bfloat16"},
        {"num_layers": 5},
        {"page_size": 32},
        {"model_fingerprint": "other"},
        {"head_dim": 64},
    ],
)
async def test_push_with_a_mismatched_layout_is_failed_precondition(decode_shim, change):
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        _, info = await _reserve(stub, "mismatch", [t + 12 for t in PROMPT])
        try:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _push(decode_shim.address, [_header(info, **change)])
        finally:
            await stub.Abort(engine_pb2.AbortRequest(request_id="mismatch"))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_remote_send_to_a_receiver_of_another_layout_is_failed_precondition(
    prefill_shim, decode_shim
):
    d_channel, d_stub = engine_stub(decode_shim.address)
    p_channel, p_stub = engine_stub(prefill_shim.address)
    async with d_channel, p_channel:
        tokens = [t + 13 for t in PROMPT]
        prep, info = await _reserve(d_stub, "mismatch-send", tokens)
        info["layout"]["dtype"] = "float16"
        await introduce(p_stub, decode_shim.address)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await p_stub.RemoteSend(
                    engine_pb2.RemoteSendRequest(
                        request_id="mismatch-send",
                        token_ids=tokens,
                        begin=0,
                        end=prep.end,
                        kv_addr_info=json.dumps(info).encode(),
                        sampling=greedy(),
                    )
                )
        finally:
            await d_stub.Abort(engine_pb2.AbortRequest(request_id="mismatch-send"))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_push_with_a_wrong_reservation_token_is_not_found(decode_shim):
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        _, info = await _reserve(stub, "wrong-token", [t + 14 for t in PROMPT])
        info["reservation_token"] = "f" * 32
        try:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _push(decode_shim.address, [_header(info)])
        finally:
            await stub.Abort(engine_pb2.AbortRequest(request_id="wrong-token"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_push_that_breaks_off_releases_the_reservation(decode_shim):
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        baseline = await free_pages(stub)
        tokens = [t + 15 for t in PROMPT]
        _, info = await _reserve(stub, "broken", tokens)
        layout = info["layout"]
        bytes_per_token = layout["num_layers"] * 2 * layout["num_kv_heads"] * layout["head_dim"] * 4
        partial = engine_pb2.KVChunkData(begin=0, num_tokens=4, data=bytes(4 * bytes_per_token))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _push(
                decode_shim.address, [_header(info), engine_pb2.PushKVRequest(chunk=partial)]
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # ended short of the window
        assert await wait_for_free_pages(stub, baseline) == baseline
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
        assert status.num_reserved_requests == 0
