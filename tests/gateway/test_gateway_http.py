"""The gateway over HTTP (official openai client and httpx) in front of the FakeRouter double:
OpenAI response shapes, streaming, usage, n, logprobs, chat."""

from __future__ import annotations

import httpx
import openai
import pytest
from gateway_fixtures import RunningGateway

from gateway.sse import parse_events

pytestmark = pytest.mark.integration


def client_for(gateway: RunningGateway, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.api_url, api_key=api_key, max_retries=0)


async def test_completion_returns_reversed_prompt_with_usage(gateway: RunningGateway) -> None:
    reply = await client_for(gateway).completions.create(model="fake", prompt="abc")
    assert reply.choices[0].text == "cba"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    assert reply.usage.total_tokens == 6


async def test_stream_joined_equals_non_stream(gateway: RunningGateway) -> None:
    client = client_for(gateway)
    whole = await client.completions.create(model="fake", prompt="hello world", temperature=0)
    stream = await client.completions.create(model="fake", prompt="hello world", temperature=0,
                                             stream=True)
    joined = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert joined == whole.choices[0].text == "dlrow olleh"


async def test_each_choice_finishes_exactly_once_when_streaming(gateway: RunningGateway) -> None:
    stream = await client_for(gateway).completions.create(model="fake", prompt="xyz", n=2,
                                                          stream=True)
    reasons: dict[int, list[str]] = {0: [], 1: []}
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                reasons[choice.index].append(choice.finish_reason)
    assert reasons == {0: ["stop"], 1: ["stop"]}


async def test_usage_is_streamed_only_with_include_usage(gateway: RunningGateway) -> None:
    client = client_for(gateway)
    plain = await client.completions.create(model="fake", prompt="ab", stream=True)
    assert all([chunk.usage is None async for chunk in plain])
    with_usage = await client.completions.create(model="fake", prompt="ab", stream=True,
                                                 stream_options={"include_usage": True})
    chunks = [chunk async for chunk in with_usage]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2
    assert all(chunk.usage is None for chunk in chunks[:-1])


async def test_several_prompts_and_n_give_prompt_major_choices(gateway: RunningGateway) -> None:
    reply = await client_for(gateway).completions.create(model="fake", prompt=["ab", "cd"], n=2)
    assert [(c.index, c.text) for c in reply.choices] == [(0, "ba"), (1, "ba"), (2, "dc"),
                                                          (3, "dc")]
    assert reply.usage is not None and reply.usage.prompt_tokens == 4


async def test_token_id_prompts_reach_the_router_as_ids(gateway: RunningGateway) -> None:
    reply = await client_for(gateway).completions.create(model="fake", prompt=[[104, 105], [111]])
    assert [c.text for c in reply.choices] == ["ih", "o"]
    assert list(gateway.router.servicer.seen[-1].token_ids.ids) == [111]


async def test_echo_prepends_the_prompt(gateway: RunningGateway) -> None:
    reply = await client_for(gateway).completions.create(model="fake", prompt="ab", echo=True)
    assert reply.choices[0].text == "abba"


async def test_max_tokens_cuts_with_length_and_stop_cuts_with_stop(gateway: RunningGateway) -> None:
    client = client_for(gateway)
    cut = await client.completions.create(model="fake", prompt="abcdef", max_tokens=2)
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == ("fe", "length")
    stopped = await client.completions.create(model="fake", prompt="abcdef", stop=["c"])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("fed", "stop")
    assert list(gateway.router.servicer.seen[-1].sampling.stop) == ["c"]


async def test_completion_logprobs_follow_the_legacy_layout(gateway: RunningGateway) -> None:
    reply = await client_for(gateway).completions.create(model="fake", prompt="ab", logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["b", "a"] and logprobs.token_logprobs == [-0.5, -0.5]
    assert logprobs.text_offset == [0, 1]
    assert logprobs.top_logprobs == [{"b": -0.5}, {"a": -0.5}]
    assert gateway.router.servicer.seen[-1].sampling.top_logprobs == 2


async def test_chat_completion_and_stream_agree(gateway: RunningGateway) -> None:
    client = client_for(gateway)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    whole = await client.chat.completions.create(model="fake", messages=messages,  # type: ignore[arg-type]
                                                 temperature=0, logprobs=True, top_logprobs=1)
    assert whole.choices[0].message.content == "ihS"
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content
    assert whole.choices[0].logprobs.content[0].top_logprobs[0].token == "i"
    stream = await client.chat.completions.create(model="fake", messages=messages,  # type: ignore[arg-type]
                                                  temperature=0, stream=True)
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    joined = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert joined == "ihS"
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
    seen = gateway.router.servicer.seen[-1]
    assert [(m.role, m.content) for m in seen.chat.messages] == [("system", "S"), ("user", "hi")]


async def test_seed_reproduces_a_sampled_output(gateway: RunningGateway) -> None:
    client = client_for(gateway)
    prompt = "the quick brown fox"
    first = await client.completions.create(model="fake", prompt=prompt, temperature=1, seed=7)
    again = await client.completions.create(model="fake", prompt=prompt, temperature=1, seed=7)
    assert first.choices[0].text == again.choices[0].text
    assert gateway.router.servicer.seen[-1].sampling.seed == 7


async def test_extensions_and_unknown_fields_are_passed_or_ignored(gateway: RunningGateway) -> None:
    body = {"model": "fake", "prompt": "ab", "top_k": 5, "ignore_eos": True,
            "microserving": {"pattern": "round-robin", "pd_balance_factor": 0.25},
            "some_future_field": {"x": 1}}
    async with httpx.AsyncClient(base_url=gateway.api_url) as http:
        reply = await http.post("/completions", json=body)
    assert reply.status_code == 200, reply.text
    seen = gateway.router.servicer.seen[-1]
    assert (seen.sampling.top_k, seen.sampling.ignore_eos) == (5, True)
    assert seen.hints.pattern == 1 and abs(seen.hints.pd_balance_factor - 0.25) < 1e-6


async def test_sse_body_is_data_events_ending_in_done(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.api_url) as http:
        reply = await http.post("/completions", json={"model": "fake", "prompt": "ab",
                                                      "stream": True})
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = parse_events(reply.content)
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["b", "a"]


async def test_models_lists_the_routers_models(gateway: RunningGateway) -> None:
    models = await client_for(gateway).models.list()
    assert [m.id for m in models.data] == ["fake"]


async def test_metrics_count_requests_and_tokens(gateway: RunningGateway) -> None:
    await client_for(gateway).completions.create(model="fake", prompt="abc")
    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        text = (await http.get("/metrics")).text
    assert 'microserving_gateway_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert "microserving_gateway_completion_tokens_total 3.0" in text
    assert "microserving_gateway_time_to_first_token_seconds_count 1.0" in text
    assert "microserving_gateway_inflight_requests 0.0" in text


async def test_streaming_several_prompts_with_n_keeps_choices_apart(
        gateway: RunningGateway) -> None:
    stream = await client_for(gateway).completions.create(
        model="fake", prompt=["ab", "cde"], n=2, stream=True,
        stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finishes: dict[int, int] = {}
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finishes[choice.index] = finishes.get(choice.index, 0) + (choice.finish_reason is not None)
    assert texts == {0: "ba", 1: "ba", 2: "edc", 3: "edc"}
    assert finishes == {0: 1, 1: 1, 2: 1, 3: 1}
    assert usage is not None and usage.completion_tokens == 10 and usage.prompt_tokens == 5


async def test_chat_stream_with_n_2_starts_each_choice_with_the_assistant_role(
        gateway: RunningGateway) -> None:
    stream = await client_for(gateway).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "xy"}], n=2, stream=True)
    first_delta: dict[int, object] = {}
    texts: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            first_delta.setdefault(choice.index, choice.delta.role)
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert first_delta == {0: "assistant", 1: "assistant"}
    assert texts == {0: "yx", 1: "yx"}


async def test_streamed_echo_sends_the_prompt_first(gateway: RunningGateway) -> None:
    stream = await client_for(gateway).completions.create(model="fake", prompt="ab", echo=True,
                                                          stream=True)
    texts = [chunk.choices[0].text async for chunk in stream]
    assert texts[0] == "ab" and "".join(texts) == "abba"


async def test_chat_unknown_model_is_404_with_an_openai_error(gateway: RunningGateway) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client_for(gateway).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}])
    assert caught.value.response.json()["error"]["code"] == "model_not_found"
