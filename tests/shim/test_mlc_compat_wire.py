"""`microserving mlc-compat` speaks MLC's engine wire as MLC's own router and tutorial use it:
requests built from MLC's pydantic types and POSTed as their `model_dump()` (null penalties,
the full debug_config), every response validated against MLC's response types, the
tutorial's CustomRouter flow (remote_send always from 0) on a repeated prompt with the prefix
cache off, `id` = `user`, completion logprobs in MLC's shape, and `usage.extra` filled."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from compat_servers import CompatServer
from mlc_protocol_models import (
    CompletionRequest,
    CompletionResponse,
    DebugConfig,
    ListResponse,
    PrepRecvRequest,
    PrepRecvResponse,
    RemoteSendRequest,
    StartGenerateRequest,
    StreamOptions,
)

from engine_shim.mlc_http.cli import parse_settings
from engine_shim.mlc_http.settings import MLCCompatSettings
from microserving.token_bytes import parse_display_token
from microserving.tokenizer import Tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

PROMPT = Tokenizer.from_model("tiny").encode("The tutorial asks the same thing twice.")
EXTRA_KEYS = {"prompt_tokens", "completion_tokens", "prefill_tokens", "decode_tokens",
              "jump_forward_tokens", "end_to_end_latency_s", "ttft_s", "inter_token_latency_s"}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engines() -> AsyncIterator[dict[str, CompatServer]]:
    """The tutorial's two engines (prefix cache off, engine 1 at recv_rank 1) and one engine
    with the default settings."""
    decode = CompatServer(MLCCompatSettings(port=0, enable_prefix_cache=False))
    await decode.start()
    prefill = CompatServer(MLCCompatSettings(port=0, enable_prefix_cache=False, peers={1: decode.url}))
    await prefill.start()
    default = CompatServer(MLCCompatSettings(port=0))
    await default.start()
    yield {"prefill": prefill, "decode": decode, "default": default}
    for server in (default, prefill, decode):
        await server.stop()


# ---- MLC's Router.send_* helpers, as MLC's router.py performs them ----
async def send_prepare_receive(session: aiohttp.ClientSession, request: PrepRecvRequest,
                               server_url: str) -> tuple[str, int]:
    async with session.post(server_url + "/microserving/prep_recv", json=request.model_dump()) as reply:
        assert reply.status == 200, await reply.text()
        body = PrepRecvResponse.model_validate(await reply.json())
    return body.kv_append_metadata, body.prefix_matched_length


async def send_remote_send(session: aiohttp.ClientSession, request: RemoteSendRequest,
                           server_url: str) -> None:
    async with session.post(server_url + "/microserving/remote_send", json=request.model_dump()) as reply:
        assert reply.status == 200, await reply.text()
        assert await reply.json() == {}


async def send_start_generate(session: aiohttp.ClientSession, request: StartGenerateRequest,
                              server_url: str) -> AsyncIterator[CompletionResponse]:
    async with session.post(server_url + "/microserving/start_generate", json=request.model_dump()) as reply:
        assert reply.status == 200, await reply.text()
        async for line in reply.content:
            raw = line.strip()
            if not raw or raw[6:].strip() == b"[DONE]":
                continue
            yield CompletionResponse.model_validate(json.loads(raw[6:]))


async def tutorial_flow(request: CompletionRequest, request_id: str, server_urls: list[str],
                        device_id_starts: list[int]) -> tuple[list[CompletionResponse], int]:
    """The MicroServing tutorial's translate_request, step for step (returns the responses
    and the prefix_matched_length it was told, which the tutorial ignores)."""
    request.user = request_id
    if request.debug_config is None:  # MLC's Router.handle_completion adds it
        request.debug_config = DebugConfig()
    responses: list[CompletionResponse] = []
    async with aiohttp.ClientSession() as session:
        assert isinstance(request.prompt, list)
        decode_start = len(request.prompt) - 1
        kv_addr_info, matched = await send_prepare_receive(
            session, PrepRecvRequest(**request.model_dump(), end=decode_start), server_urls[1])
        await send_remote_send(session, RemoteSendRequest(
            **request.model_dump(), begin=0, end=decode_start, kv_addr_info=kv_addr_info,
            recv_rank=device_id_starts[1]), server_urls[0])
        async for response in send_start_generate(
                session, StartGenerateRequest(**request.model_dump(), begin=decode_start), server_urls[1]):
            responses.append(response)
    return responses, matched


async def post_completion(url: str, request: CompletionRequest) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions",
                                                                json=request.model_dump()) as reply:
        if not request.stream or reply.status != 200:
            return reply.status, await reply.json()
        chunks = []
        async for line in reply.content:
            raw = line.strip()
            if raw and raw[6:].strip() != b"[DONE]":
                chunks.append(CompletionResponse.model_validate(json.loads(raw[6:])))
        return reply.status, chunks


def greedy_request(**fields: Any) -> CompletionRequest:
    return CompletionRequest(**{"model": "tiny", "prompt": list(PROMPT), "max_tokens": 10,
                                "temperature": 0.0, **fields})


def text_of(responses: list[CompletionResponse]) -> str:
    return "".join(c.text for r in responses for c in r.choices)


async def test_tutorial_flow_on_a_repeated_prompt_matches_one_engine_with_the_prefix_cache_off(engines):
    urls = [engines["prefill"].url, engines["decode"].url]
    status, alone = await post_completion(engines["prefill"].url, greedy_request())
    assert status == 200
    alone = CompletionResponse.model_validate(alone)
    runs = [await tutorial_flow(greedy_request(stream=True), f"tutorial-{i}", urls, [0, 1, 2])
            for i in range(2)]
    for responses, matched in runs:
        assert matched == 0  # the prefix cache is off: the tutorial's begin=0 window fits
        assert text_of(responses) == alone.choices[0].text
        assert responses[-1].choices[-1].finish_reason == "length"
    assert {r.id for responses, _ in runs for r in responses} == {"tutorial-0", "tutorial-1"}


async def test_the_default_engine_reuses_a_repeated_prompts_prefix(engines):
    url = engines["default"].url
    assert (await post_completion(url, greedy_request(max_tokens=1)))[0] == 200
    request = PrepRecvRequest(**greedy_request(user="cached", debug_config=DebugConfig()).model_dump(),
                              end=len(PROMPT) - 1)
    async with aiohttp.ClientSession() as session:
        _, matched = await send_prepare_receive(session, request, url)
    assert matched > 0
    assert parse_settings([]).enable_prefix_cache is True  # as `mlc_llm serve`
    assert parse_settings(["--prefix-cache-mode", "disable"]).enable_prefix_cache is False
    assert parse_settings(["--enable-prefix-cache", "false"]).enable_prefix_cache is False


async def test_round_robin_forwarding_with_null_penalties_is_served_and_answers_as_mlc(engines):
    """MLC's round-robin mode POSTs `request.model_dump()` to /v1/completions: null
    penalties, a full debug_config, null response_format."""
    url = engines["default"].url
    body = greedy_request(debug_config=DebugConfig(), user="rr-1").model_dump()
    assert body["frequency_penalty"] is None and body["presence_penalty"] is None
    status, reply = await post_completion(url, greedy_request(debug_config=DebugConfig(), user="rr-1"))
    assert status == 200, reply
    response = CompletionResponse.model_validate(reply)
    assert response.id == "rr-1" and response.usage is not None
    status, chunks = await post_completion(url, greedy_request(
        debug_config=DebugConfig(), stream=True, stream_options=StreamOptions(include_usage=True)))
    assert status == 200
    assert text_of(chunks) == response.choices[0].text
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")  # no user: fresh id
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    for usage in (response.usage, chunks[-1].usage):
        assert usage.extra is not None and set(usage.extra) >= EXTRA_KEYS
        assert 0 < usage.extra["prefill_tokens"] <= usage.prompt_tokens
        assert usage.extra["decode_tokens"] == usage.completion_tokens - 1
        assert usage.extra["end_to_end_latency_s"] >= usage.extra["ttft_s"] > 0
    async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as models:
        ListResponse.model_validate(await models.json())


async def test_start_generate_reports_only_the_locally_prefilled_tokens(engines):
    urls = [engines["prefill"].url, engines["decode"].url]
    responses, _ = await tutorial_flow(
        greedy_request(stream=True, stream_options=StreamOptions(include_usage=True)),
        "extra-pd", urls, [0, 1, 2])
    usage = responses[-1].usage
    assert usage is not None and usage.extra is not None
    assert usage.prompt_tokens == len(PROMPT)
    assert usage.extra["prefill_tokens"] == 1  # the rest of the prompt's KV came from engine 0


async def test_completion_logprobs_come_in_mlcs_shape(engines):
    url = engines["default"].url
    status, reply = await post_completion(url, greedy_request(logprobs=3, max_tokens=12))
    assert status == 200
    choice = CompletionResponse.model_validate(reply).choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and len(logprobs.tokens) == 12
    assert b"".join(parse_display_token(t) for t in logprobs.tokens).decode("utf-8", "replace") == choice.text
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 3 and top[token] == value == max(top.values())  # greedy: the best token
    status, chunks = await post_completion(url, greedy_request(logprobs=3, max_tokens=12, stream=True))
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert status == 200 and streamed == logprobs.tokens


@pytest.mark.parametrize("fields, words", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"debug_config": {"special_request": "query_engine_metrics"}}, "special_request"),
    ({"debug_config": {"pinned_system_prompt": True}}, "pinned_system_prompt"),
    ({"logprobs": 6}, "logprobs"),
])
async def test_options_this_engine_cannot_honour_are_refused(engines, fields, words):
    body = {"prompt": list(PROMPT), "max_tokens": 2, **fields}
    async with aiohttp.ClientSession() as session, session.post(
            engines["default"].url + "/v1/completions", json=body) as reply:
        assert reply.status == 400
        assert words in (await reply.json())["error"]["message"]
