"""A RemoteSend made before its receiver is known (RemoteSendRequest.kv_addr_follows), against
real shim processes: P computes from the send's message on, D's address follows in a
`send_to` on P's stream, and D's tokens are exactly one engine's alone, on every way the
embedded backend moves KV (NIXL with the agent in the shim or beside a core process of its
own, the shared-memory stage, the gRPC push) and for a receiver that already holds part of
the prompt. A send cancelled while it waits, a send_to outside the send's window and a
caller that half-closes first end it and leave no page held on P; the unary call and a send
that carries an address as well are refused."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import grpc
import pytest
from shim_helpers import (
    PROMPT,
    ShimProcess,
    engine_stub,
    free_pages,
    generate_alone,
    greedy,
    introduce,
    logged_path,
    next_output,
    prep_recv_message,
    reserve_on_stream,
    start_after_kv_message,
    start_shim,
    streamed_tokens,
    wait_for_free_pages,
)

from engine_shim.backends.embedded.kv_plane.nixl import load_nixl
from microserving.transport import status_code
from microserving.v1 import engine_pb2

NIXL, WHY_NOT = load_nixl()
pytestmark = pytest.mark.e2e

# (P, D, the path P's log names): the agent in the shim, beside the engine core, no NIXL on P
LAYOUTS = ["nixl-thread", "nixl-core", "shm", "grpc"]
_prompts = itertools.count()


@pytest.fixture(scope="module")
def push_senders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ShimProcess]]:
    """Prefill shims without NIXL: one writes D's shared-memory stage, one pushes over gRPC."""
    tmp = tmp_path_factory.mktemp("push-senders")
    shims = {kind: start_shim(tmp, f"prefill-{kind}", "--role", "prefill", "--kv-transport", kind)
             for kind in ("shm", "grpc")}
    yield shims
    for shim in shims.values():
        shim.stop()


def _pair(request: pytest.FixtureRequest, layout: str) -> tuple[ShimProcess, ShimProcess]:
    if layout.startswith("nixl") and NIXL is None:
        pytest.skip(WHY_NOT)
    if layout == "nixl-core":
        shims = request.getfixturevalue("process_core_shims")
        return shims["prefill"], shims["decode"]
    decode: ShimProcess = request.getfixturevalue("decode_shim")
    if layout == "nixl-thread":
        return request.getfixturevalue("prefill_shim"), decode
    return request.getfixturevalue("push_senders")[layout], decode


def _send_ahead(request_id: str, tokens: list[int], **fields: object) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(remote_send=engine_pb2.RemoteSendRequest(
        request_id=request_id, token_ids=tokens, begin=0, end=-1, sampling=greedy(),
        kv_addr_follows=True, **fields))  # type: ignore[arg-type]


def _send_to(request_id: str, prep: engine_pb2.PrepRecvResponse, begin: int | None = None
             ) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(send_to=engine_pb2.RemoteSendTarget(
        request_id=request_id, kv_addr_info=prep.kv_addr_info,
        begin=prep.prefix_matched_length if begin is None else begin))


def _fresh_prompt(length: int) -> list[int]:
    """A prompt no engine of the session has seen (its first token differs)."""
    n = next(_prompts)
    return [200 + n % 50, *[10 + (i * 7 + n) % 180 for i in range(length - 1)]]


async def _pages_held(stub, baseline: int) -> bool:
    """Whether the engine holds pages beyond `baseline` within a while (the send computed)."""
    for _ in range(500):
        if await free_pages(stub) < baseline:
            return True
        await asyncio.sleep(0.02)
    return False


async def _ahead_flow(p_call, d_call, request_id: str, tokens: list[int]
                      ) -> tuple[list[int], engine_pb2.PrepRecvResponse, engine_pb2.GenerateOutput]:
    """P's send first, then D's reservation and waiting start, then D's address to P: D's
    tokens, D's PrepRecv answer and P's RemoteSend output."""
    await p_call.write(_send_ahead(request_id, tokens))
    prep = await reserve_on_stream(d_call, request_id, tokens)
    await d_call.write(start_after_kv_message(request_id, tokens, prep.end))
    await p_call.write(_send_to(request_id, prep))
    ids = await streamed_tokens(d_call, request_id)
    return ids, prep, await next_output(p_call, request_id)


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_a_send_made_before_its_receiver_is_known_matches_one_engine(request, layout: str) -> None:
    prefill, decode = _pair(request, layout)
    first = _fresh_prompt(300)  # 19 pages of 16
    # Shares 12 pages with `first`: D holds them, only the rest moves (a sub-window of P's send).
    second = first[:200] + [t + 3 for t in first[200:]]
    p_channel, p_stub = engine_stub(prefill.address)
    d_channel, d_stub = engine_stub(decode.address)
    async with p_channel, d_channel:
        await introduce(p_stub, decode.address)
        p_baseline, d_baseline = await free_pages(p_stub), await free_pages(d_stub)
        p_call, d_call = p_stub.Generate(), d_stub.Generate()
        got, prep, sent = await _ahead_flow(p_call, d_call, f"ahead-{layout}", first)
        assert prep.prefix_matched_length < 16 and prep.end == 299
        assert sent.HasField("remote_send"), sent
        assert sent.remote_send.num_tokens_sent == 299 - prep.prefix_matched_length
        got_2, prep_2, sent_2 = await _ahead_flow(p_call, d_call, f"ahead-{layout}-2", second)
        assert prep_2.prefix_matched_length == 192
        assert sent_2.HasField("remote_send") and sent_2.remote_send.num_tokens_sent == 299 - 192
        for call in (p_call, d_call):
            await call.done_writing()
            assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF
        assert await wait_for_free_pages(p_stub, p_baseline, within_s=2.0) == p_baseline
        assert await wait_for_free_pages(d_stub, d_baseline, within_s=2.0) == d_baseline
    # A staged push goes on the receiver's PushKVStream.
    path = "nixl" if layout.startswith("nixl") else "shm-stream" if layout == "shm" else layout
    assert await logged_path(prefill, f"ahead-{layout}") == path
    assert await logged_path(prefill, f"ahead-{layout}-2") == path
    # The reference after the flow, so P's send computed the prompt rather than found it cached.
    assert got == await generate_alone(decode.address, f"ahead-alone-{layout}", first)
    assert got_2 == await generate_alone(decode.address, f"ahead-alone-{layout}-2", second)
    assert len(got) == 16


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_a_send_cancelled_before_its_receiver_came_frees_its_pages(request, layout: str) -> None:
    prefill, _ = _pair(request, layout)
    tokens = _fresh_prompt(120)
    channel, stub = engine_stub(prefill.address)
    async with channel:
        baseline = await free_pages(stub)
        call = stub.Generate()
        await call.write(_send_ahead("ahead-cancelled", tokens))
        assert await _pages_held(stub, baseline)  # computed and held, waiting for D's address
        await call.write(engine_pb2.EngineGenerateRequest(cancel=engine_pb2.GenerateCancel(
            request_id="ahead-cancelled")))
        assert await wait_for_free_pages(stub, baseline, within_s=2.0) == baseline
        # A send_to for it now has no send to go to: dropped, and the stream serves on.
        await call.write(_send_to("ahead-cancelled", engine_pb2.PrepRecvResponse(kv_addr_info=b"{}")))
        await call.write(prep_recv_message("after-cancel", [*PROMPT[:20], 5]))
        output = await next_output(call, "after-cancel")
        assert output.HasField("prep_recv"), output
        await call.write(engine_pb2.EngineGenerateRequest(cancel=engine_pb2.GenerateCancel(
            request_id="after-cancel")))
        assert await wait_for_free_pages(stub, baseline, within_s=2.0) == baseline
        call.cancel()


async def test_a_send_to_outside_the_sends_window_fails_it_and_frees_its_pages(
    prefill_shim, decode_shim
) -> None:
    tokens = _fresh_prompt(120)
    p_channel, p_stub = engine_stub(prefill_shim.address)
    d_channel, d_stub = engine_stub(decode_shim.address)
    async with p_channel, d_channel:
        await introduce(p_stub, decode_shim.address)
        baseline = await free_pages(p_stub)
        p_call, d_call = p_stub.Generate(), d_stub.Generate()
        await p_call.write(_send_ahead("ahead-outside", tokens))
        prep = await reserve_on_stream(d_call, "ahead-outside", tokens)
        await p_call.write(_send_to("ahead-outside", prep, begin=len(tokens) - 1))  # the window's end
        output = await next_output(p_call, "ahead-outside")
        assert status_code(output.error.code) == grpc.StatusCode.INVALID_ARGUMENT, output
        assert "outside the RemoteSend's window" in output.error.message
        assert await wait_for_free_pages(p_stub, baseline, within_s=2.0) == baseline
        assert (await d_stub.Abort(engine_pb2.AbortRequest(request_id="ahead-outside"))).was_active
        d_call.cancel()
        p_call.cancel()


async def test_a_send_still_waiting_when_its_caller_half_closes_fails(prefill_shim) -> None:
    channel, stub = engine_stub(prefill_shim.address)
    async with channel:
        baseline = await free_pages(stub)
        call = stub.Generate()
        await call.write(_send_ahead("ahead-half-closed", _fresh_prompt(60)))
        await call.done_writing()
        output = await next_output(call, "ahead-half-closed")
        assert status_code(output.error.code) == grpc.StatusCode.INVALID_ARGUMENT, output
        assert "closed before this RemoteSend's send_to" in output.error.message
        assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF
        assert await wait_for_free_pages(stub, baseline, within_s=2.0) == baseline


async def test_a_send_whose_receiver_follows_is_offered_on_the_stream_only(prefill_shim) -> None:
    tokens = _fresh_prompt(40)
    channel, stub = engine_stub(prefill_shim.address)
    async with channel:
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
        assert status.takes_kv_addr_later
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.RemoteSend(_send_ahead("ahead-unary", tokens).remote_send, timeout=30)
        assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Engine.Generate only" in (unary.value.details() or "")
        call = stub.Generate()
        await call.write(_send_ahead("ahead-with-address", tokens, kv_addr_info=b"{}"))
        output = await next_output(call, "ahead-with-address")
        assert status_code(output.error.code) == grpc.StatusCode.INVALID_ARGUMENT, output
        assert "send the address in send_to" in output.error.message
        call.cancel()
