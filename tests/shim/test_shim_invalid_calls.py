"""Every bad call from the engine's bad-input list, sent over gRPC to a shim process, gets
its status code while another request on the same shim streams to the end with the tokens it
gets alone."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from shim_helpers import PROMPT, engine_stub, generate, greedy

from microserving.v1 import common_pb2, engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.e2e

Code = grpc.StatusCode
Stub = Any  # engine_pb2_grpc.EngineAsyncStub exists only in the .pyi


def _sampling(**fields: float) -> common_pb2.SamplingParams:
    sampling = greedy()
    for name, value in fields.items():
        setattr(sampling, name, value)
    return sampling


async def _prep(
    stub: Stub,
    request_id: str = "bad",
    tokens: list[int] = PROMPT,
    end: int = -1,
    sampling: common_pb2.SamplingParams | None = None,
    whole_prompt: bool = False,
):
    return await stub.PrepRecv(
        engine_pb2.PrepRecvRequest(
            request_id=request_id, token_ids=tokens, end=end, sampling=sampling or greedy(),
            whole_prompt=whole_prompt,
        )
    )


async def _send(stub: Stub, begin: int, end: int, kv_addr_info: bytes = b"{}"):
    return await stub.RemoteSend(
        engine_pb2.RemoteSendRequest(
            request_id="bad", token_ids=PROMPT, begin=begin, end=end, kv_addr_info=kv_addr_info
        )
    )


async def _gen(
    stub: Stub,
    begin: int = 0,
    tokens: list[int] = PROMPT,
    sampling: common_pb2.SamplingParams | None = None,
    request_id: str = "bad",
):
    return await generate(stub, request_id, tokens, begin, sampling)


async def _duplicate_prep_recv(stub: Stub):
    await _prep(stub, request_id="dup")
    try:
        await _prep(stub, request_id="dup")
    finally:
        await stub.Abort(engine_pb2.AbortRequest(request_id="dup"))


BAD_CALLS: dict[str, tuple[Callable[[Stub], Awaitable[object]], grpc.StatusCode]] = {
    "empty prompt": (lambda s: _gen(s, tokens=[]), Code.INVALID_ARGUMENT),
    "token id above the vocabulary": (
        lambda s: _gen(s, tokens=[*PROMPT, 100_000]),
        Code.INVALID_ARGUMENT,
    ),
    "negative token id": (lambda s: _prep(s, tokens=[-1, *PROMPT]), Code.INVALID_ARGUMENT),
    "prep_recv end >= len": (lambda s: _prep(s, end=len(PROMPT)), Code.INVALID_ARGUMENT),
    "prep_recv end below -len": (lambda s: _prep(s, end=-len(PROMPT) - 1), Code.INVALID_ARGUMENT),
    "prep_recv whole_prompt end > len": (
        lambda s: _prep(s, end=len(PROMPT) + 1, whole_prompt=True), Code.INVALID_ARGUMENT),
    "remote_send begin >= end": (lambda s: _send(s, 10, 10), Code.INVALID_ARGUMENT),
    "remote_send end >= len": (lambda s: _send(s, 0, len(PROMPT)), Code.INVALID_ARGUMENT),
    "remote_send malformed kv_addr_info": (
        lambda s: _send(s, 0, 10, b"not json"),
        Code.INVALID_ARGUMENT,
    ),
    "start_generate begin >= len": (lambda s: _gen(s, begin=len(PROMPT)), Code.INVALID_ARGUMENT),
    "empty request id": (lambda s: _gen(s, request_id=""), Code.INVALID_ARGUMENT),
    "request id too long": (lambda s: _gen(s, request_id="x" * 257), Code.INVALID_ARGUMENT),
    "request id not printable": (lambda s: _gen(s, request_id="a\nb"), Code.INVALID_ARGUMENT),
    "duplicate request id": (_duplicate_prep_recv, Code.ALREADY_EXISTS),
    "start_generate begin > 0 without prep_recv": (
        lambda s: _gen(s, begin=5, request_id="unknown-id"),
        Code.FAILED_PRECONDITION,
    ),
    "prompt + max_tokens beyond the context": (
        lambda s: _gen(s, sampling=_sampling(max_tokens=2048)),
        Code.INVALID_ARGUMENT,
    ),
    "prompt longer than the context": (
        lambda s: _gen(s, tokens=PROMPT * 41),
        Code.INVALID_ARGUMENT,
    ),
    "negative temperature": (
        lambda s: _gen(s, sampling=_sampling(temperature=-0.5)),
        Code.INVALID_ARGUMENT,
    ),
    "top_p zero": (lambda s: _gen(s, sampling=_sampling(top_p=0.0)), Code.INVALID_ARGUMENT),
    "top_p above one": (lambda s: _gen(s, sampling=_sampling(top_p=1.5)), Code.INVALID_ARGUMENT),
    "n zero": (lambda s: _gen(s, sampling=_sampling(n=0)), Code.INVALID_ARGUMENT),
    "max_tokens zero": (lambda s: _gen(s, sampling=_sampling(max_tokens=0)), Code.INVALID_ARGUMENT),
}


async def test_every_bad_call_gets_its_status_while_another_request_streams(decode_shim):
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        tokens = [t + 60 for t in PROMPT]
        expected = await generate(stub, "reference", tokens, sampling=greedy(max_tokens=120))
        # Long enough to outlast the bad calls on a loaded machine (120 tokens did not: the
        # stream had ended before the last one ran); its first 120 tokens are the reference's.
        streaming = asyncio.create_task(
            generate(stub, "alongside", tokens, sampling=greedy(max_tokens=1500))
        )
        codes: dict[str, grpc.StatusCode] = {}
        for name, (call, _) in BAD_CALLS.items():
            try:
                await call(stub)
            except grpc.aio.AioRpcError as error:
                codes[name] = error.code()
            else:
                codes[name] = Code.OK
        assert not streaming.done(), "the bad calls should run while the stream is running"
        assert (await streaming)[:120] == expected
    assert codes == {name: code for name, (_, code) in BAD_CALLS.items()}


async def test_push_of_an_unknown_reservation_is_not_found(decode_shim):
    from microserving.transport import TransportSettings, create_channel

    status_channel, stub = engine_stub(decode_shim.address)
    async with status_channel:
        layout = (await stub.GetStatus(engine_pb2.GetStatusRequest())).kv_layout
    async with create_channel(decode_shim.address, TransportSettings()) as channel:
        kv = engine_pb2_grpc.KVTransferStub(channel)
        header = engine_pb2.KVPushHeader(
            request_id="nobody", reservation_token="0" * 32, layout=layout
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await kv.PushKV(iter([engine_pb2.PushKVRequest(header=header)]))
    assert caught.value.code() == Code.NOT_FOUND
