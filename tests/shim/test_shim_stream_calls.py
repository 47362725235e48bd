"""PrepRecv and RemoteSend made on Engine.Generate streams, against real shim processes: the
PD flow over the two engines' streams gives exactly the unary flow's tokens; a bad call fails
alone with the unary call's status code; a RemoteSend whose receiver is gone says the
receiver is at fault, as the unary call's trailing metadata does; a call cancelled on the
stream leaves no KV behind and the stream keeps serving; the multiplexer cancels a call the
caller cancels, then aborts its request on the engine (also when the call had ended), and
answers the others at once, whatever its stream interval; actions batched in one message run
as if each came alone; the router's end of such a call
times out with DEADLINE_EXCEEDED (the engine's call cancelled and its request aborted) and
raises the unary call's error, the receiver's fault included."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import grpc
import pytest
from shim_helpers import (
    PROMPT,
    engine_stub,
    free_pages,
    generate_alone,
    greedy,
    introduce,
    next_output,
    prep_recv_message,
    remote_send_message,
    reserve_on_stream,
    streamed_tokens,
    until_none,
    wait_for_free_pages,
)

from engine_shim.backends.embedded.kv_plane.addr import KVAddrInfo
from engine_shim.backends.embedded.kv_plane.sender import ReceiverUnavailableError
from engine_shim.multiplex import GenerateMultiplexer
from microserving.transport import (
    FAULT_METADATA_KEY,
    FAULT_RECEIVER,
    TransportSettings,
    status_code,
)
from microserving.v1 import engine_pb2, engine_pb2_grpc
from router.endpoint import Endpoint
from router.engines import EngineStream

pytestmark = pytest.mark.e2e


def _start(request_id: str, tokens: list[int], begin: int) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(start=engine_pb2.StartGenerateRequest(
        request_id=request_id, token_ids=tokens, begin=begin, sampling=greedy()))


def _cancel(request_id: str) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(cancel=engine_pb2.GenerateCancel(request_id=request_id))


async def test_both_engines_say_they_serve_calls_on_their_streams(prefill_shim, decode_shim) -> None:
    for shim in (prefill_shim, decode_shim):
        channel, stub = engine_stub(shim.address)
        async with channel:
            status = await stub.GetStatus(engine_pb2.GetStatusRequest())
        assert status.serves_stream_calls


async def test_pd_over_the_streams_matches_one_engine_alone(prefill_shim, decode_shim) -> None:
    tokens = [*PROMPT[:40], 77, 78]  # a prompt neither engine has seen in another test
    want = await generate_alone(prefill_shim.address, "alone", tokens)
    p_channel, p_stub = engine_stub(prefill_shim.address)
    d_channel, d_stub = engine_stub(decode_shim.address)
    async with p_channel, d_channel:
        await introduce(p_stub, decode_shim.address)
        baseline = await free_pages(d_stub)
        d_call, p_call = d_stub.Generate(), p_stub.Generate()
        prep = await reserve_on_stream(d_call, "streamed", tokens)
        assert prep.end == len(tokens) - 1 and prep.prefix_matched_length < prep.end
        await p_call.write(remote_send_message("streamed", tokens, prep))
        sent_output = await next_output(p_call, "streamed")
        assert sent_output.HasField("remote_send"), sent_output
        assert sent_output.remote_send.num_tokens_sent == prep.end - prep.prefix_matched_length
        await d_call.write(_start("streamed", tokens, prep.end))
        assert await streamed_tokens(d_call, "streamed") == want
        for call in (d_call, p_call):
            await call.done_writing()
            assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF
        # Nothing stays reserved: only the prefix cache keeps the prompt (evictable: free).
        assert await wait_for_free_pages(d_stub, baseline, within_s=2.0) == baseline


async def test_actions_batched_in_one_message_run_as_if_each_came_alone(decode_shim) -> None:
    """EngineGenerateRequest.batch (what a router queues behind a write in flight): each
    start runs exactly as alone; a batch inside the batch starts nothing; the stream ends
    as usual."""
    prompts = {"batched-a": [*PROMPT[:20], 41], "batched-b": [*PROMPT[:25], 42]}
    want = {rid: await generate_alone(decode_shim.address, f"{rid}-alone", ids) for rid, ids in prompts.items()}
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        assert (await stub.GetStatus(engine_pb2.GetStatusRequest())).takes_batched_actions
        nested = engine_pb2.EngineGenerateRequest(batch=engine_pb2.EngineGenerateActions(
            actions=[_start("nested", prompts["batched-a"], 0)]))
        actions = [_start(rid, ids, 0) for rid, ids in prompts.items()] + [nested]
        call = stub.Generate()
        await call.write(engine_pb2.EngineGenerateRequest(batch=engine_pb2.EngineGenerateActions(actions=actions)))
        got: dict[str, list[int]] = {rid: [] for rid in prompts}
        finished: set[str] = set()
        while finished != set(prompts):
            message = await asyncio.wait_for(call.read(), 60)
            for output in message.outputs:
                assert output.request_id in prompts and not output.HasField("error"), output
                for choice in output.choices:
                    got[output.request_id].extend(choice.token_ids)
                if output.HasField("usage"):
                    finished.add(output.request_id)
        assert got == want
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF


async def _unary_code(coroutine) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await coroutine
    return caught.value.code()


async def test_a_bad_call_fails_alone_with_the_unary_calls_code(prefill_shim, decode_shim) -> None:
    tokens = [*PROMPT[:30], 90]
    p_channel, p_stub = engine_stub(prefill_shim.address)
    d_channel, d_stub = engine_stub(decode_shim.address)
    async with p_channel, d_channel:
        bad_prep = prep_recv_message("bad-prep", [1, 10**7, 3]).prep_recv  # outside the vocabulary
        bad_send = remote_send_message("bad-send", tokens, engine_pb2.PrepRecvResponse(end=10),
                                kv_addr_info=b"not an address").remote_send
        want = {
            "bad-prep": await _unary_code(d_stub.PrepRecv(bad_prep)),
            "bad-send": await _unary_code(p_stub.RemoteSend(bad_send)),
        }
        assert want == {"bad-prep": grpc.StatusCode.INVALID_ARGUMENT, "bad-send": grpc.StatusCode.INVALID_ARGUMENT}
        d_call, p_call = d_stub.Generate(), p_stub.Generate()
        await d_call.write(engine_pb2.EngineGenerateRequest(prep_recv=bad_prep))
        await p_call.write(engine_pb2.EngineGenerateRequest(remote_send=bad_send))
        got_prep, got_send = await next_output(d_call, "bad-prep"), await next_output(p_call, "bad-send")
        assert status_code(got_prep.error.code) == want["bad-prep"] and got_prep.error.message
        assert status_code(got_send.error.code) == want["bad-send"] and got_send.error.message
        assert not got_prep.error.fault and not got_send.error.fault
        # The streams carry on: a good call on each.
        await d_call.write(prep_recv_message("good", tokens))
        good = await next_output(d_call, "good")
        assert good.HasField("prep_recv") and not good.HasField("error")
        await d_stub.Abort(engine_pb2.AbortRequest(request_id="good"))
        d_call.cancel()
        p_call.cancel()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_send_to_a_receiver_that_is_gone_blames_the_receiver(prefill_shim, decode_shim) -> None:
    """The same fault on both paths: UNAVAILABLE, and the receiver (not the sender) at fault."""
    tokens = [*PROMPT[:30], 91]
    p_channel, p_stub = engine_stub(prefill_shim.address)
    d_channel, d_stub = engine_stub(decode_shim.address)
    async with p_channel, d_channel:
        baseline = await free_pages(d_stub)
        gone = f"127.0.0.1:{_closed_port()}"
        await introduce(p_stub, decode_shim.address, gone)
        results = []
        for path in ("unary", "stream"):
            request_id = f"gone-{path}"
            prep = await d_stub.PrepRecv(prep_recv_message(request_id, tokens).prep_recv)
            addr = KVAddrInfo.decode(prep.kv_addr_info)
            # Where the KV should go is a receiver that is not there (no shared stage either).
            elsewhere = dataclasses.replace(addr, address=gone, shm=None).encode()
            send = remote_send_message(request_id, tokens, prep, kv_addr_info=elsewhere)
            if path == "unary":
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await p_stub.RemoteSend(send.remote_send)
                results.append((caught.value.code(), dict(caught.value.trailing_metadata() or ()).get(FAULT_METADATA_KEY)))
            else:
                call = p_stub.Generate()
                await call.write(send)
                output = await next_output(call, request_id)
                results.append((status_code(output.error.code), output.error.fault))
                call.cancel()
            await d_stub.Abort(engine_pb2.AbortRequest(request_id=request_id))
        assert results == [(grpc.StatusCode.UNAVAILABLE, FAULT_RECEIVER)] * 2
        assert await wait_for_free_pages(d_stub, baseline, within_s=2.0) == baseline


async def test_a_call_cancelled_on_the_stream_leaves_no_kv_and_the_stream_serves_on(prefill_shim, decode_shim) -> None:
    """Cancelled right after it was written, a RemoteSend either never finishes or finished
    first; either way P holds no pages for it afterwards and D's reservation goes with its
    Abort (after the fence, when the Abort met a NIXL write), and the same stream then
    carries a whole PD flow."""
    tokens = [*PROMPT[:60], 92]
    p_channel, p_stub = engine_stub(prefill_shim.address)
    d_channel, d_stub = engine_stub(decode_shim.address)
    async with p_channel, d_channel:
        await introduce(p_stub, decode_shim.address)
        p_baseline, d_baseline = await free_pages(p_stub), await free_pages(d_stub)
        d_call, p_call = d_stub.Generate(), p_stub.Generate()
        await d_call.write(prep_recv_message("cancelled", tokens))
        prep = (await next_output(d_call, "cancelled")).prep_recv
        await p_call.write(remote_send_message("cancelled", tokens, prep))
        await p_call.write(_cancel("cancelled"))
        await d_stub.Abort(engine_pb2.AbortRequest(request_id="cancelled"))
        assert await wait_for_free_pages(p_stub, p_baseline, within_s=5.0) == p_baseline, "P"
        # Where the send went over NIXL (a shim with an agent) and the Abort came during the
        # write, D holds the pages back for the write's deadline and a margin (the fence: a
        # one-sided write may still land), about 11 s; then they are free.
        assert await wait_for_free_pages(d_stub, d_baseline, within_s=20.0) == d_baseline, "D"
        tokens = [*PROMPT[:59], 93, 92]
        await d_call.write(prep_recv_message("after", tokens))
        prep = (await next_output(d_call, "after")).prep_recv
        await p_call.write(remote_send_message("after", tokens, prep))
        sent = await next_output(p_call, "after")
        # The cancelled call's output, if it finished before the cancel, came before this one.
        assert sent.HasField("remote_send"), sent
        await d_call.write(_start("after", tokens, prep.end))
        assert len(await streamed_tokens(d_call, "after")) == greedy().max_tokens
        d_call.cancel()
        p_call.cancel()


async def _never_generates(start, emit) -> None:  # type: ignore[no-untyped-def]
    raise AssertionError("no generation in these tests: the calls' path is under test")


class _HeldCalls:
    """The servicer's part of a call, held until the test lets it go (the multiplexer alone
    is under test here: whether it cancels, answers and times calls as the protocol says)."""

    def __init__(self) -> None:
        self.started: dict[str, asyncio.Event] = {}
        self.release = asyncio.Event()
        self.cancelled: list[str] = []
        self.aborted: list[str] = []

    async def _held(self, request_id: str) -> None:
        self.started.setdefault(request_id, asyncio.Event()).set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise

    async def prep_recv(self, request: engine_pb2.PrepRecvRequest, traceparent: str) -> engine_pb2.PrepRecvResponse:
        await self._held(request.request_id)
        return engine_pb2.PrepRecvResponse(kv_addr_info=traceparent.encode(), end=7)

    async def remote_send(self, request: engine_pb2.RemoteSendRequest, traceparent: str) -> engine_pb2.RemoteSendResponse:
        await self._held(request.request_id)
        return engine_pb2.RemoteSendResponse(num_tokens_sent=3)

    async def abort(self, request_id: str) -> bool:
        assert request_id not in self.started or request_id in self.cancelled or self.release.is_set(), \
            "aborted while its call still ran"
        self.aborted.append(request_id)
        return True


async def test_the_multiplexer_cancels_a_held_call_and_answers_the_others_at_once() -> None:
    calls = _HeldCalls()
    # An interval of an hour: a call's answer that waited for it would never come.
    multiplexer = GenerateMultiplexer(_never_generates, stream_interval_s=3600.0, calls=calls)
    incoming: asyncio.Queue[engine_pb2.EngineGenerateRequest | None] = asyncio.Queue()
    messages = multiplexer.serve(until_none(incoming))
    first = asyncio.ensure_future(anext(messages))
    traceparent = "00-0123456789abcdef0123456789abcdef-0123456789abcdef-01"
    prep = prep_recv_message("kept", [1, 2, 3]).prep_recv
    prep.traceparent = traceparent
    await incoming.put(engine_pb2.EngineGenerateRequest(prep_recv=prep))
    await incoming.put(remote_send_message("dropped", [1, 2, 3], engine_pb2.PrepRecvResponse(end=2)))
    for request_id in ("kept", "dropped"):
        await asyncio.wait_for(calls.started.setdefault(request_id, asyncio.Event()).wait(), 60)
    await incoming.put(_cancel("dropped"))
    while not calls.cancelled:
        await asyncio.sleep(0.01)
    calls.release.set()
    message = await asyncio.wait_for(first, 60)
    (output,) = message.outputs
    assert output.request_id == "kept" and output.prep_recv.end == 7
    assert output.prep_recv.kv_addr_info == traceparent.encode()  # the message's trace context
    assert calls.cancelled == ["dropped"]
    # What the cancelled call may have done on the engine is undone: its request is aborted
    # once its task has ended. A cancel that comes after a call ended (its answer crossed
    # the cancel) aborts the request too; the answered call is not aborted otherwise.
    while "dropped" not in calls.aborted:
        await asyncio.sleep(0.01)
    await incoming.put(_cancel("kept"))
    while "kept" not in calls.aborted:
        await asyncio.sleep(0.01)
    assert calls.aborted == ["dropped", "kept"]
    # Once the caller half-closes, the stream ends: nothing more came for the cancelled call.
    await incoming.put(None)
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(messages), 60)


class _HeldEngine(engine_pb2_grpc.EngineServicer):
    """Engine.Generate served by the shim's own multiplexer over held calls (no engine: the
    two ends of the stream are under test)."""

    def __init__(self, calls: _HeldCalls) -> None:
        self.calls = calls

    async def Generate(self, requests, context):  # type: ignore[no-untyped-def]  # noqa: N802
        async for batch in GenerateMultiplexer(_never_generates, calls=self.calls).serve(requests):
            yield batch


class _FailingCalls(_HeldCalls):
    async def remote_send(self, request: engine_pb2.RemoteSendRequest, traceparent: str) -> engine_pb2.RemoteSendResponse:
        raise ReceiverUnavailableError("KV push to the receiver failed: gone")


async def test_the_routers_end_times_out_cancels_and_maps_errors_as_the_unary_call() -> None:
    calls = _FailingCalls()
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(_HeldEngine(calls), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    endpoint = Endpoint(address=f"127.0.0.1:{port}", configured_roles=None)
    endpoint.connect(TransportSettings())
    endpoint.status = engine_pb2.GetStatusResponse(serves_stream_calls=True)
    stream = EngineStream(endpoint)
    try:
        assert stream.takes_calls("slow")
        with pytest.raises(grpc.aio.AioRpcError) as timed_out:
            await stream.call("slow", prep_recv_message("slow", [1, 2, 3]), timeout_s=0.2)
        assert timed_out.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        # The engine's call was cancelled and its request aborted, as after a unary deadline.
        while "slow" not in calls.aborted:
            await asyncio.sleep(0.01)
        assert calls.cancelled == ["slow"]
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stream.call("send", remote_send_message("send", [1, 2, 3], engine_pb2.PrepRecvResponse(end=2)), None)
        assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
        assert dict(failed.value.trailing_metadata()) == {FAULT_METADATA_KEY: FAULT_RECEIVER}
        calls.release.set()
        output = await stream.call("fine", prep_recv_message("fine", [1, 2, 3]), timeout_s=60)
        assert output.prep_recv.end == 7
    finally:
        await stream.close()
        await endpoint.channel.close()  # type: ignore[union-attr]
        await server.stop(None)
