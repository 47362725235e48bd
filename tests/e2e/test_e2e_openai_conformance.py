"""The stack `microserving up` starts, seen by OpenAI's own clients: the official `openai` SDK
raises each of its error classes where OpenAI would (BadRequest, Authentication, NotFound,
RateLimit, InternalServer), `param` names the client's field, models.retrieve works, a chat
stream has OpenAI's chunk shape, seeded choices of two requests differ, and litellm maps a
too-long prompt to its ContextWindowExceededError."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from e2e_up import ROOT, UpStack, start_up

from microserving.stack.process import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

API_KEY = "conformance-key"
MAX_INFLIGHT = 2


@pytest.fixture(scope="module")
def stack() -> Iterator[UpStack]:
    running = start_up("--api-key", API_KEY, "--max-inflight", str(MAX_INFLIGHT))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(stack: UpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def context_length(client: openai.OpenAI) -> int:
    card = client.models.retrieve("tiny")
    return int((card.model_extra or {})["max_model_len"])


def error_body(error: openai.APIStatusError) -> dict[str, Any]:
    body = error.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body  # type: ignore[no-any-return]


# ---- BadRequestError ----
def test_a_prompt_over_the_context_is_bad_request_context_length_exceeded(
        client: openai.OpenAI, context_length: int) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x" * (context_length + 8), max_tokens=1)
    body = error_body(caught.value)
    assert (body["code"], body["param"]) == ("context_length_exceeded", "prompt")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=context_length)
    body = error_body(caught.value)
    assert (body["code"], body["param"]) == ("context_length_exceeded", "max_tokens")
    assert "maximum context length" in body["message"]


@pytest.mark.parametrize(("call", "param"), [
    (lambda c: c.completions.create(model="tiny", prompt="hi", temperature=5), "temperature"),
    (lambda c: c.completions.create(model="tiny", prompt="hi", logprobs=9), "logprobs"),
    (lambda c: c.completions.create(model="tiny", prompt="", max_tokens=2), "prompt"),
    (lambda c: c.chat.completions.create(model="tiny", messages=[], max_tokens=2), "messages"),
    (lambda c: c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                         logprobs=True, top_logprobs=30), "top_logprobs"),
])
def test_bad_fields_are_bad_requests_naming_the_clients_field(client: openai.OpenAI, call: Any,
                                                               param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        call(client)
    assert error_body(caught.value)["param"] == param


def test_a_body_that_is_not_json_names_no_field(stack: UpStack) -> None:
    reply = httpx.post(f"{stack.base_url}/completions", content=b'{"model": "tiny", "prompt": ',
                       headers={"Authorization": f"Bearer {API_KEY}",
                                "Content-Type": "application/json"})
    body = reply.json()["error"]
    assert reply.status_code == 400 and body["param"] is None and "JSON" in body["message"]


# ---- AuthenticationError, NotFoundError, models.retrieve ----
def test_a_wrong_api_key_is_an_authentication_error(stack: UpStack) -> None:
    wrong = openai.OpenAI(base_url=stack.base_url, api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert error_body(caught.value)["type"] == "authentication_error"


def test_models_retrieve_and_unknown_models_are_not_found(client: openai.OpenAI) -> None:
    card = client.models.retrieve("tiny")
    assert (card.id, card.object) == ("tiny", "model")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert error_body(caught.value)["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)


# ---- RateLimitError ----
def test_over_the_inflight_limit_is_a_rate_limit_error(client: openai.OpenAI) -> None:
    # Near the tiny model's whole context each, so none can finish while the test is still
    # opening the others and sending one more, even on a loaded machine (400 tokens could).
    streams = [client.completions.create(model="tiny", prompt="Go on", max_tokens=2000, stream=True,
                                         extra_body={"ignore_eos": True})
               for _ in range(MAX_INFLIGHT)]
    try:
        for stream in streams:
            next(iter(stream))  # each holds an admission slot now
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model="tiny", prompt="one more", max_tokens=1)
        assert int(caught.value.response.headers["retry-after"]) >= 1
    finally:
        for stream in streams:
            stream.close()


# ---- InternalServerError ----
def test_a_gateway_without_its_router_is_an_internal_server_error() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    gateway = subprocess.Popen(
        [sys.executable, "-m", "microserving.cli", "gateway", "--router", f"127.0.0.1:{free_port()}",
         "--port", "0"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert gateway.stdout is not None
        address = re.search(r"listening on (\S+:\d+)", gateway.stdout.readline())
        assert address is not None
        dead = openai.OpenAI(base_url=f"http://{address.group(1)}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            dead.completions.create(model="tiny", prompt="hi", max_tokens=1)
        assert caught.value.status_code == 503
        assert error_body(caught.value)["type"] == "service_unavailable_error"
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)


# ---- litellm ----
def test_litellm_maps_a_too_long_prompt_to_its_context_window_error(
        stack: UpStack, context_length: int) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    litellm = pytest.importorskip("litellm")
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model="openai/tiny", api_base=stack.base_url, api_key=API_KEY,
                           messages=[{"role": "user", "content": "x" * (context_length + 8)}],
                           max_tokens=1, num_retries=0)


# ---- the chat stream's chunk shape ----
def _chat_chunks(stack: UpStack, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as reply:
        assert reply.status_code == 200
        lines = [line[len("data: "):] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("n", [1, 2])
def test_chat_stream_sends_the_role_once_first_and_no_empty_chunks(
        stack: UpStack, client: openai.OpenAI, n: int) -> None:
    # The tiny model emits arbitrary bytes, so tokens that end inside a UTF-8 character (no
    # text yet) are common: each must not become a chunk of its own.
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say something"}],
            "max_tokens": 48, "temperature": 0.9, "seed": 7, "n": n}
    whole = client.chat.completions.create(**body)  # type: ignore[call-overload]
    chunks = _chat_chunks(stack, body)
    for index in range(n):
        deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks
                  if c["choices"] and c["choices"][0]["index"] == index]
        assert deltas[0][0].get("role") == "assistant"
        assert all("role" not in delta for delta, _ in deltas[1:])
        assert all(delta.get("content") or reason for delta, reason in deltas[1:])
        assert [reason for _, reason in deltas if reason] == [whole.choices[index].finish_reason]
        assert "".join(d.get("content") or "" for d, _ in deltas) == whole.choices[index].message.content


# ---- seeds ----
def test_seeded_choices_of_two_requests_never_share_a_generator(client: openai.OpenAI) -> None:
    def texts(seed: int) -> list[str]:
        reply = client.completions.create(model="tiny", prompt="Pick", max_tokens=16, n=2,
                                          temperature=1.0, seed=seed)
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    first, second = texts(1), texts(2)
    assert texts(1) == first  # seeded: reproducible
    assert first[1] != second[0]  # seed 1's second choice is not seed 2's first


# ---- logprobs of tokens that split a UTF-8 character ----
# The tiny model's token i is the byte i: 0xE2 opens a three-byte character, so a token of
# it alone is never whole text. A logit bias makes the model emit it.
PARTIAL = {"226": 100}


def test_completion_logprobs_show_partial_characters_as_bytes_without_collisions(
        client: openai.OpenAI) -> None:
    reply = client.completions.create(model="tiny", prompt="Bytes", max_tokens=3, logprobs=5,
                                      temperature=0, logit_bias=PARTIAL)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens == ["bytes:\\xe2"] * 3
    assert logprobs.top_logprobs is not None
    # Every alternative keeps its own key: single bytes >= 0x80 would all be U+FFFD as text.
    assert all(len(top) == 5 for top in logprobs.top_logprobs)
    free = client.completions.create(model="tiny", prompt="Bytes", max_tokens=8, logprobs=5,
                                     temperature=0)
    assert free.choices[0].logprobs is not None and free.choices[0].logprobs.top_logprobs is not None
    assert all(len(top) == 5 for top in free.choices[0].logprobs.top_logprobs)


def test_chat_logprob_bytes_are_the_tokens_raw_bytes(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Bytes"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=20, logit_bias=PARTIAL)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [entry.bytes for entry in content] == [[0xE2]] * 3
    for entry in content:
        alternatives = [tuple(alt.bytes or ()) for alt in entry.top_logprobs]
        assert len(set(alternatives)) == 20 and (0xEF, 0xBF, 0xBD) not in alternatives
        # bytes that open or continue a character, each as itself (not as U+FFFD's bytes)
        assert any(len(raw) == 1 and raw[0] >= 0x80 for raw in alternatives)
