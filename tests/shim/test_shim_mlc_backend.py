"""The MLC backend, end to end against real engines: two MLC-wire-compatible servers (the
embedded engine behind MLC's exact HTTP routes, peered by recv_rank) behind two `--backend mlc`
shims carry a PD request over gRPC and return the tokens the embedded shim returns directly.
An ASGI hook records the JSON each shim sent, which is checked field by field against MLC's
wire format; the same two servers also carry MLC's PD flow driven over plain HTTP."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
import pytest_asyncio
from compat_servers import CompatServer
from shim_helpers import PROMPT, engine_stub, greedy

from engine_shim.mlc_http.settings import MLCCompatSettings
from engine_shim.server import ShimServer
from engine_shim.settings import ShimSettings
from microserving.v1 import engine_pb2

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mlc_pair() -> AsyncIterator[dict[str, Any]]:
    receiver = CompatServer(MLCCompatSettings(port=0))
    await receiver.start()
    sender = CompatServer(MLCCompatSettings(port=0, peers={0: receiver.url}))
    await sender.start()
    decode = ShimServer(ShimSettings(backend="mlc", mlc_url=receiver.url, port=0, role="decode"))
    prefill = ShimServer(ShimSettings(backend="mlc", mlc_url=sender.url, port=0, role="prefill"))
    await decode.start()
    await prefill.start()
    yield {"receiver": receiver, "sender": sender, "decode": decode, "prefill": prefill}
    for shim in (prefill, decode):
        await shim.stop(grace_s=1.0)
    for server in (sender, receiver):
        await server.stop()


async def _stream(
    stub: Any, request_id: str, tokens: list[int], begin: int
) -> tuple[list[int], str, int]:
    request = engine_pb2.StartGenerateRequest(
        request_id=request_id, token_ids=tokens, begin=begin, sampling=greedy()
    )
    ids, text, finish = [], "", 0
    async for response in stub.StartGenerate(request):
        for choice in response.choices:
            ids.extend(choice.token_ids)
            text += choice.text
            finish = choice.finish_reason or finish
    return ids, text, finish


async def test_mlc_backend_pd_returns_the_embedded_shims_tokens(mlc_pair, prefill_shim):
    tokens = [t + 30 for t in PROMPT]
    embedded_channel, embedded = engine_stub(prefill_shim.address)
    d_channel, d_stub = engine_stub(mlc_pair["decode"].address)
    p_channel, p_stub = engine_stub(mlc_pair["prefill"].address)
    async with embedded_channel, d_channel, p_channel:
        expected = await _stream(embedded, "embedded-direct", tokens, 0)
        prep = await d_stub.PrepRecv(
            engine_pb2.PrepRecvRequest(
                request_id="mlc-pd", token_ids=tokens, end=-1, sampling=greedy()
            )
        )
        sent = await p_stub.RemoteSend(
            engine_pb2.RemoteSendRequest(
                request_id="mlc-pd",
                token_ids=tokens,
                begin=prep.prefix_matched_length,
                end=-1,
                kv_addr_info=prep.kv_addr_info,
                recv_rank=0,
                sampling=greedy(),
            )
        )
        pd = await _stream(d_stub, "mlc-pd", tokens, -1)
        alone = await _stream(p_stub, "mlc-alone", tokens, 0)
    assert prep.end == len(tokens) - 1 and sent.num_tokens_sent == len(tokens) - 1
    assert len(expected[0]) == 16
    assert pd == expected and alone == expected  # ids, text and finish reason


async def test_mlc_backend_serves_the_multiplexed_generate_stream(mlc_pair, prefill_shim):
    """Engine.Generate runs over any backend's per-request streams: three interleaved
    requests on an MLC-backend shim give the embedded shim's tokens; a cancelled one ends
    quietly while the others finish."""
    prompts = {f"mux-{i}": [t + 20 + i for t in PROMPT] for i in range(3)}
    embedded_channel, embedded = engine_stub(prefill_shim.address)
    p_channel, p_stub = engine_stub(mlc_pair["prefill"].address)
    async with embedded_channel, p_channel:
        expected = {rid: (await _stream(embedded, f"ref-{rid}", tokens, 0))[0] for rid, tokens in prompts.items()}
        call = p_stub.Generate()
        for rid, tokens in prompts.items():
            await call.write(engine_pb2.EngineGenerateRequest(start=engine_pb2.StartGenerateRequest(
                request_id=rid, token_ids=tokens, sampling=greedy())))
        await call.write(engine_pb2.EngineGenerateRequest(start=engine_pb2.StartGenerateRequest(
            request_id="mux-cancelled", token_ids=PROMPT, sampling=greedy(max_tokens=1500))))
        await call.write(engine_pb2.EngineGenerateRequest(
            cancel=engine_pb2.GenerateCancel(request_id="mux-cancelled")))
        got: dict[str, list[int]] = {}
        finished: set[str] = set()
        while finished != set(prompts):
            message = await asyncio.wait_for(call.read(), 60)
            for output in message.outputs:
                assert not output.HasField("error"), output.error
                for choice in output.choices:
                    got.setdefault(output.request_id, []).extend(choice.token_ids)
                if output.HasField("usage"):
                    finished.add(output.request_id)
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF
    assert {rid: got[rid] for rid in prompts} == expected
    assert "mux-cancelled" not in finished


async def test_mlc_backend_sends_mlcs_exact_request_json(mlc_pair):
    tokens = [t + 40 for t in PROMPT]
    d_channel, d_stub = engine_stub(mlc_pair["decode"].address)
    p_channel, p_stub = engine_stub(mlc_pair["prefill"].address)
    async with d_channel, p_channel:
        prep = await d_stub.PrepRecv(
            engine_pb2.PrepRecvRequest(
                request_id="wire", token_ids=tokens, end=-1, sampling=greedy()
            )
        )
        await p_stub.RemoteSend(
            engine_pb2.RemoteSendRequest(
                request_id="wire",
                token_ids=tokens,
                begin=0,
                end=-1,
                kv_addr_info=prep.kv_addr_info,
                recv_rank=0,
                sampling=greedy(),
            )
        )
        await _stream(d_stub, "wire", tokens, -1)
    receiver, sender = mlc_pair["receiver"].recorder, mlc_pair["sender"].recorder
    ((prep_body, prep_reply),) = [
        c for c in receiver.bodies("/microserving/prep_recv") if c[0]["user"] == "wire"
    ]
    ((send_body, _),) = [
        c for c in sender.bodies("/microserving/remote_send") if c[0]["user"] == "wire"
    ]
    ((gen_body, _),) = [
        c for c in receiver.bodies("/microserving/start_generate") if c[0]["user"] == "wire"
    ]
    end = len(tokens) - 1  # the shim normalises end=-1 before MLC sees it
    reply = json.loads(prep_reply)
    assert (
        set(reply) == {"kv_append_metadata", "prefix_matched_length"}
        and reply["prefix_matched_length"] == 0
    )
    metadata = json.loads(base64.b64decode(reply["kv_append_metadata"]))
    assert metadata[0] * 2 + 1 == len(metadata) and sum(metadata[2::2]) == end
    assert prep_body["end"] == end and prep_body["prompt"] == tokens
    assert send_body["begin"] == 0 and send_body["end"] == end and send_body["recv_rank"] == 0
    assert send_body["kv_addr_info"] == reply["kv_append_metadata"] == prep.kv_addr_info.decode()
    assert gen_body["begin"] == end and gen_body["stream"] is True
    for body in (prep_body, send_body, gen_body):
        assert body["user"] == "wire" and body["prompt"] == tokens
        assert body["debug_config"] == {"ignore_eos": True}  # non-null; ignore_eos lives here
        assert body["temperature"] == 0.0 and body["max_tokens"] == 16
        assert "begin" not in body or isinstance(body["begin"], int)


async def test_two_compat_servers_carry_mlcs_pd_flow_over_http(mlc_pair):
    """What MLC's router does: prep_recv on D, remote_send on P, start_generate on D."""
    receiver, sender = mlc_pair["receiver"].url, mlc_pair["sender"].url
    tokens = [t + 70 for t in PROMPT]
    base = {
        "model": "tiny",
        "prompt": tokens,
        "max_tokens": 12,
        "temperature": 0.0,
        "user": "http-pd",
        "debug_config": {"ignore_eos": True},
    }
    async with httpx.AsyncClient(timeout=60.0) as client:
        prep = (
            await client.post(f"{receiver}/microserving/prep_recv", json={**base, "end": -1})
        ).json()
        send = await client.post(
            f"{sender}/microserving/remote_send",
            json={
                **base,
                "begin": prep["prefix_matched_length"],
                "end": -1,
                "kv_addr_info": prep["kv_append_metadata"],
                "recv_rank": 0,
            },
        )
        text, finish = "", None
        async with client.stream(
            "POST",
            f"{receiver}/microserving/start_generate",
            json={**base, "begin": -1, "stream": True},
        ) as stream:
            events = [line async for line in stream.aiter_lines() if line.startswith("data:")]
        for event in events[:-1]:
            for choice in json.loads(event[5:])["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
        alone = (
            await client.post(f"{sender}/v1/completions", json={**base, "user": "http-alone"})
        ).json()
        models = (await client.get(f"{receiver}/v1/models")).json()
    assert send.status_code == 200 and send.json() == {}
    assert events[-1] == "data: [DONE]"
    assert alone["object"] == "text_completion" and alone["usage"]["completion_tokens"] == 12
    assert (
        text == alone["choices"][0]["text"]
        and finish == alone["choices"][0]["finish_reason"] == "length"
    )
    assert models["data"][0]["id"] == "tiny"


async def test_compat_server_rejects_bad_windows_without_dying(mlc_pair):
    receiver = mlc_pair["receiver"].url
    base = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0.0, "debug_config": {}}
    async with httpx.AsyncClient(timeout=60.0) as client:
        bad_end = await client.post(
            f"{receiver}/microserving/prep_recv", json={**base, "user": "w1", "end": len(PROMPT)}
        )
        no_prep = await client.post(
            f"{receiver}/microserving/start_generate", json={**base, "user": "w2", "begin": 5}
        )
        fine = await client.post(f"{receiver}/v1/completions", json=base)
    assert bad_end.status_code == 400 and bad_end.json()["error"]["type"] == "invalid_request_error"
    assert no_prep.status_code == 409
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 2


async def test_mlc_backend_refuses_a_cache_salt_it_cannot_scope_and_serves_it_without_a_prefix_cache(mlc_pair):
    """MLC's prefix cache has one scope: a tenant's (salted) request is refused with a message
    that says so, on every call, unless the shim declares the MLC engine runs without a prefix
    cache; then nothing is shared and the request is served."""
    salted = greedy(max_tokens=4)
    salted.cache_salt = "tenant-a"
    tokens = [t + 40 for t in PROMPT]
    d_channel, d_stub = engine_stub(mlc_pair["decode"].address)
    async with d_channel:
        for call in (
            d_stub.PrepRecv(engine_pb2.PrepRecvRequest(request_id="salt-prep", token_ids=tokens,
                                                       end=-1, sampling=salted)),
            _drain(d_stub.StartGenerate(engine_pb2.StartGenerateRequest(
                request_id="salt-start", token_ids=tokens, sampling=salted))),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cache_salt" in (refused.value.details() or "")
    unshared = ShimServer(ShimSettings(backend="mlc", mlc_url=mlc_pair["receiver"].url, port=0,
                                       enable_prefix_cache=False))
    await unshared.start()
    try:
        channel, stub = engine_stub(unshared.address)
        async with channel:
            request = engine_pb2.StartGenerateRequest(request_id="salt-served", token_ids=tokens,
                                                      sampling=salted)
            ids = await _drain(stub.StartGenerate(request))
        assert len(ids) == 4
    finally:
        await unshared.stop(grace_s=1.0)


async def _drain(call: Any) -> list[int]:
    return [i async for reply in call for choice in reply.choices for i in choice.token_ids]


async def test_mlc_backend_refuses_a_start_after_the_kv_and_does_not_offer_it(mlc_pair):
    """MLC's engines move KV themselves and never tell the shim it landed: the shim's status
    does not offer starts after a KV transfer, and such a start is refused with a message on
    both paths (a router then makes its RemoteSend first, as MLC's own router does)."""
    tokens = [t + 50 for t in PROMPT]
    d_channel, d_stub = engine_stub(mlc_pair["decode"].address)
    async with d_channel:
        status = await d_stub.GetStatus(engine_pb2.GetStatusRequest())
        assert status.serves_stream_calls and not status.starts_after_kv_transfer
        start = engine_pb2.StartGenerateRequest(request_id="after-kv", token_ids=tokens, begin=0,
                                                sampling=greedy(), after_kv_transfer=True)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _drain(d_stub.StartGenerate(start))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "after_kv_transfer" in (refused.value.details() or "")
        call = d_stub.Generate()
        await call.write(engine_pb2.EngineGenerateRequest(start=start))
        message = await asyncio.wait_for(call.read(), 30)
        (output,) = message.outputs
        assert output.request_id == "after-kv"
        assert output.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "after_kv_transfer" in output.error.message
        call.cancel()


async def test_the_mlc_backend_refuses_a_send_whose_receiver_follows(mlc_pair) -> None:
    """MLC's remote_send is one HTTP call that takes the receiver's address with it: the
    shim does not offer RemoteSendRequest.kv_addr_follows and refuses it on the stream."""
    p_channel, p_stub = engine_stub(mlc_pair["prefill"].address)
    async with p_channel:
        status = await p_stub.GetStatus(engine_pb2.GetStatusRequest())
        assert status.serves_stream_calls and not status.takes_kv_addr_later
        call = p_stub.Generate()
        await call.write(engine_pb2.EngineGenerateRequest(remote_send=engine_pb2.RemoteSendRequest(
            request_id="follows", token_ids=list(range(10, 40)), begin=0, end=-1, sampling=greedy(),
            kv_addr_follows=True)))
        message = await asyncio.wait_for(call.read(), 30)
        (output,) = message.outputs
        assert output.request_id == "follows"
        assert output.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "kv_addr_follows" in output.error.message
        call.cancel()


async def test_the_mlc_backend_offers_no_first_token_flow_and_refuses_its_calls(mlc_pair) -> None:
    """MLC's engines cannot sample on the sending side nor continue another engine's choices:
    the status does not offer it, and a whole-prompt PrepRecv or a start with continuations
    is refused with a message, the engine untouched."""
    tokens = [t + 60 for t in PROMPT]
    d_channel, d_stub = engine_stub(mlc_pair["decode"].address)
    async with d_channel:
        status = await d_stub.GetStatus(engine_pb2.GetStatusRequest())
        assert not status.samples_first_token
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await d_stub.PrepRecv(engine_pb2.PrepRecvRequest(
                request_id="whole", token_ids=tokens, end=len(tokens), sampling=greedy(), whole_prompt=True))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "whole_prompt" in (refused.value.details() or "")
        start = engine_pb2.StartGenerateRequest(
            request_id="continues", token_ids=tokens, begin=len(tokens), sampling=greedy(),
            continuations=[engine_pb2.ChoiceContinuation(index=0, token_ids=[5])])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _drain(d_stub.StartGenerate(start))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "continuations" in (refused.value.details() or "")
        after = await d_stub.GetStatus(engine_pb2.GetStatusRequest())
        assert after.num_reserved_requests == 0
