"""A start that waits for its KV (StartGenerateRequest.after_kv_transfer), against real shim
processes: sent to D before P's RemoteSend (on the Generate stream, or as a StartGenerate
call), it begins once the KV has landed and its tokens are exactly one engine's alone; it
ends with FAILED_PRECONDITION when its reservation ends without the KV (aborted) or when
there is none, and leaves no page behind; the embedded shim says it serves such starts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
from shim_helpers import (
    PROMPT,
    ShimProcess,
    engine_stub,
    free_pages,
    generate_alone,
    introduce,
    next_output,
    prep_recv_message,
    remote_send_message,
    reserve_on_stream,
    start_after_kv_message,
    start_shim,
    streamed_tokens,
    wait_for_free_pages,
)

from microserving.transport import status_code
from microserving.v1 import engine_pb2

pytestmark = pytest.mark.e2e


async def _settled(call, request_id: str) -> None:
    """The stream has handled what was written before: a reservation made and dropped after
    it is answered (a start that did not wait would have failed by then, its engine call
    made first)."""
    await reserve_on_stream(call, request_id, [*PROMPT[:20], 3])
    await call.write(engine_pb2.EngineGenerateRequest(cancel=engine_pb2.GenerateCancel(request_id=request_id)))


async def test_the_embedded_shim_serves_starts_after_the_kv(decode_shim) -> None:
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
    assert status.starts_after_kv_transfer


@pytest.fixture(scope="module")
def shim_waiting_decode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShimProcess]:
    """A decode shim whose starts after the KV wait in the shim, not in the engine core."""
    shim = start_shim(tmp_path_factory.mktemp("shim-wait"), "decode-shim-wait", "--role", "decode",
                      "--start-after-kv-in-engine", "false")
    yield shim
    shim.stop()


@pytest.mark.parametrize("waits_in", ["engine", "shim"])
async def test_a_start_sent_before_the_send_begins_once_the_kv_lands(request, prefill_shim, waits_in: str) -> None:
    """The start waits in the engine core (the default) or, with start_after_kv_in_engine
    off, in the shim; either way it begins once the KV has landed, tokens exact."""
    decode_shim = request.getfixturevalue("decode_shim" if waits_in == "engine" else "shim_waiting_decode")
    tokens = [*PROMPT[:40], 81 + (waits_in == "shim"), 82]  # a prompt no engine has seen in another test
    want = await generate_alone(prefill_shim.address, f"alone-after-kv-{waits_in}", tokens)
    p_channel, p_stub = engine_stub(prefill_shim.address)
    d_channel, d_stub = engine_stub(decode_shim.address)
    async with p_channel, d_channel:
        await introduce(p_stub, decode_shim.address)
        baseline = await free_pages(d_stub)
        d_call, p_call = d_stub.Generate(), p_stub.Generate()
        prep = await reserve_on_stream(d_call, "after-kv", tokens)
        assert prep.prefix_matched_length < prep.end == len(tokens) - 1
        await d_call.write(start_after_kv_message("after-kv", tokens, prep.end))
        await _settled(d_call, "after-kv-sentinel")
        # Only now does the KV go: the start is waiting for it on D, not failed.
        await p_call.write(remote_send_message("after-kv", tokens, prep))
        assert await streamed_tokens(d_call, "after-kv") == want
        sent = await next_output(p_call, "after-kv")
        assert sent.HasField("remote_send") and sent.remote_send.num_tokens_sent == prep.end - prep.prefix_matched_length
        for call in (d_call, p_call):
            await call.done_writing()
            assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF
        assert await wait_for_free_pages(d_stub, baseline, within_s=2.0) == baseline


async def test_a_waiting_start_fails_when_its_reservation_ends_without_the_kv(decode_shim) -> None:
    tokens = [*PROMPT[:40], 83, 84]
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        baseline = await free_pages(stub)
        call = stub.Generate()
        prep = await reserve_on_stream(call, "never-sent", tokens)
        await call.write(start_after_kv_message("never-sent", tokens, prep.end))
        await _settled(call, "never-sent-sentinel")
        reply = await stub.Abort(engine_pb2.AbortRequest(request_id="never-sent"))
        assert reply.was_active
        output = await next_output(call, "never-sent")
        assert status_code(output.error.code) == grpc.StatusCode.FAILED_PRECONDITION, output
        assert "before its KV arrived" in output.error.message
        # The stream serves on, and nothing stays reserved.
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
        assert status.num_reserved_requests == 0
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF
        assert await wait_for_free_pages(stub, baseline, within_s=2.0) == baseline


async def test_a_start_after_the_kv_without_a_reservation_fails(decode_shim) -> None:
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        call = stub.Generate()
        # begin 0 needs no KV from elsewhere, but a wait for a transfer needs a reservation
        await call.write(start_after_kv_message("no-reservation", [*PROMPT[:10], 85], 0))
        output = await next_output(call, "no-reservation")
        assert status_code(output.error.code) == grpc.StatusCode.FAILED_PRECONDITION, output
        assert "no open KV reservation" in output.error.message
        call.cancel()


async def test_the_unary_start_after_the_kv_waits_for_the_send_too(prefill_shim, decode_shim) -> None:
    """StartGenerate (one call per request) takes the same mark: the call made before
    RemoteSend streams the engine-alone tokens once the KV has landed."""
    tokens = [*PROMPT[:40], 86, 87]
    want = await generate_alone(prefill_shim.address, "alone-unary-after-kv", tokens)
    p_channel, p_stub = engine_stub(prefill_shim.address)
    d_channel, d_stub = engine_stub(decode_shim.address)
    async with p_channel, d_channel:
        await introduce(p_stub, decode_shim.address)
        prep = await d_stub.PrepRecv(prep_recv_message("unary-after-kv", tokens).prep_recv)
        start = start_after_kv_message("unary-after-kv", tokens, prep.end).start

        async def decode() -> list[int]:
            return [t async for m in d_stub.StartGenerate(start, timeout=60) for c in m.choices for t in c.token_ids]

        decoding = asyncio.ensure_future(decode())
        await asyncio.sleep(0.2)  # the start is made first (it waits either way)
        assert not decoding.done()
        sent = await p_stub.RemoteSend(remote_send_message("unary-after-kv", tokens, prep).remote_send, timeout=60)
        assert sent.num_tokens_sent == prep.end - prep.prefix_matched_length
        assert await asyncio.wait_for(decoding, 60) == want
