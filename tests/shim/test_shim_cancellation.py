"""No request leaves KV behind on either shim: a stream cancelled midway, a client process
that is SIGKILLed mid-stream, and an expiring deadline each bring both shims' free pages back
to their baseline within one second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import grpc
import pytest
from shim_helpers import (
    PROMPT,
    engine_stub,
    free_pages,
    greedy,
    introduce,
    subprocess_env,
    wait_for_free_pages,
)

from microserving.v1 import engine_pb2

pytestmark = pytest.mark.e2e

LONG = greedy(max_tokens=1500)  # far longer than any test waits


async def _start_pd_stream(
    prefill_address: str, decode_address: str, request_id: str, tokens: list[int]
):
    """PrepRecv on D, RemoteSend from P; returns D's stub, its channel and the generate request."""
    p_channel, p_stub = engine_stub(prefill_address)
    d_channel, d_stub = engine_stub(decode_address)
    prep = await d_stub.PrepRecv(
        engine_pb2.PrepRecvRequest(request_id=request_id, token_ids=tokens, end=-1, sampling=LONG)
    )
    await introduce(p_stub, decode_address)
    await p_stub.RemoteSend(
        engine_pb2.RemoteSendRequest(
            request_id=request_id,
            token_ids=tokens,
            begin=0,
            end=prep.end,
            kv_addr_info=prep.kv_addr_info,
            sampling=LONG,
        )
    )
    await p_channel.close()
    request = engine_pb2.StartGenerateRequest(
        request_id=request_id, token_ids=tokens, begin=prep.end, sampling=LONG
    )
    return d_channel, d_stub, request


async def _baselines(*addresses: str) -> list[int]:
    values = []
    for address in addresses:
        channel, stub = engine_stub(address)
        async with channel:
            values.append(await free_pages(stub))
    return values


async def _assert_back_to_baseline(addresses: tuple[str, ...], baselines: list[int]) -> None:
    for address, baseline in zip(addresses, baselines, strict=True):
        channel, stub = engine_stub(address)
        async with channel:
            assert await wait_for_free_pages(stub, baseline, within_s=1.0) == baseline, address


async def test_cancelling_a_stream_midway_frees_pages_on_both_shims(prefill_shim, decode_shim):
    addresses = (prefill_shim.address, decode_shim.address)
    baselines = await _baselines(*addresses)
    tokens = [t + 3 for t in PROMPT] * 4  # 200 tokens: 13 pages
    channel, stub, request = await _start_pd_stream(*addresses, "cancel-midway", tokens)
    call = stub.StartGenerate(request)
    received = 0
    async for response in call:
        received += sum(len(c.token_ids) for c in response.choices)
        if received >= 3:
            break
    call.cancel()
    await channel.close()
    assert received >= 3
    await _assert_back_to_baseline(addresses, baselines)


CLIENT = textwrap.dedent(
    """
    import asyncio, sys
    from microserving.transport import TransportSettings, create_channel
    from microserving.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    async def main():
        channel = create_channel(sys.argv[1], TransportSettings())
        stub = engine_pb2_grpc.EngineStub(channel)
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
        request = engine_pb2.StartGenerateRequest(
            request_id="killed-client", token_ids=list(range(20, 120)), sampling=sampling)
        async for _ in stub.StartGenerate(request):
            print("streaming", flush=True)

    asyncio.run(main())
    """
)


async def test_killing_the_client_process_frees_pages(prefill_shim, decode_shim):
    addresses = (prefill_shim.address, decode_shim.address)
    baselines = await _baselines(*addresses)
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, decode_shim.address],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
    )
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == b"streaming"  # the stream is running
        os.kill(client.pid, signal.SIGKILL)
        client.wait(timeout=10)
    finally:
        if client.poll() is None:
            client.kill()
    await _assert_back_to_baseline(addresses, baselines)


async def test_an_expired_deadline_aborts_the_request_and_frees_pages(prefill_shim, decode_shim):
    addresses = (prefill_shim.address, decode_shim.address)
    baselines = await _baselines(*addresses)
    tokens = [t + 7 for t in PROMPT] * 2
    channel, stub, request = await _start_pd_stream(*addresses, "deadline", tokens)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.StartGenerate(request, timeout=0.5):
            pass
    await channel.close()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await _assert_back_to_baseline(addresses, baselines)


async def test_a_prep_recv_aborted_by_id_frees_its_reservation(decode_shim):
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        baseline = await free_pages(stub)
        await stub.PrepRecv(
            engine_pb2.PrepRecvRequest(
                request_id="abort-me", token_ids=[t + 9 for t in PROMPT], end=-1
            )
        )
        assert await free_pages(stub) < baseline
        aborted = await stub.Abort(engine_pb2.AbortRequest(request_id="abort-me"))
        again = await stub.Abort(engine_pb2.AbortRequest(request_id="abort-me"))
        assert aborted.was_active and not again.was_active
        assert await wait_for_free_pages(stub, baseline) == baseline
