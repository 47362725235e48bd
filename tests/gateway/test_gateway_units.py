"""Pure parts of the gateway: protocol models, conversion to router messages, the error table,
SSE framing, API keys, admission and settings."""

from __future__ import annotations

import grpc
import pytest
from pydantic import ValidationError

from gateway.admission import AdmissionLimit
from gateway.auth import ApiKeyChecker
from gateway.errors import GatewayError, client_param, from_code_number, from_grpc
from gateway.protocol.chat import ChatCompletionRequest
from gateway.protocol.completion import CompletionRequest
from gateway.router_requests import chat_request, completion_requests, finish_reason_text
from gateway.settings import GatewaySettings, reject_unknown_env
from gateway.sse import DONE_EVENT, encode_event, parse_events
from microserving.v1 import common_pb2, router_pb2


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_every_openai_prompt_form_becomes_a_list_of_prompts(prompt: object,
                                                            expected: list[object]) -> None:
    assert CompletionRequest(model="m", prompt=prompt).prompts == expected  # type: ignore[arg-type]


def test_empty_prompts_and_out_of_range_fields_are_rejected() -> None:
    for bad in ({"prompt": []}, {"prompt": [[]]}, {"prompt": "a", "logprobs": 6},
                {"prompt": "a", "temperature": -1}, {"prompt": "a", "best_of": 2},
                {"prompt": "a", "stream_options": {"include_usage": True}}):
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", **bad)  # type: ignore[arg-type]


def test_unknown_fields_are_kept_aside_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO"):
        request = CompletionRequest(model="m", prompt="a", brand_new=1)  # type: ignore[call-arg]
    assert request.ignored_fields == ["brand_new"]
    assert "brand_new" in caplog.text


def test_completion_converts_every_sampling_field() -> None:
    request = CompletionRequest(
        model="m", prompt=["x", "y"], max_tokens=7, temperature=0.5, top_p=0.9, n=2, stop="\n",
        seed=3, frequency_penalty=0.1, presence_penalty=-0.2, logit_bias={"5": 1.5}, logprobs=3,
        echo=True, top_k=4, ignore_eos=True, stop_token_ids=[9],
        microserving={"pattern": "disagg", "pd_balance_factor": 0.1, "cache_aware": True})
    messages = completion_requests(request, "cmpl-1")
    assert [m.request_id for m in messages] == ["cmpl-1-0", "cmpl-1-1"]
    assert [m.text for m in messages] == ["x", "y"]
    sampling = messages[0].sampling
    assert (sampling.max_tokens, sampling.n, list(sampling.stop), sampling.seed) == (7, 2, ["\n"], 3)
    assert abs(sampling.temperature - 0.5) < 1e-6 and abs(sampling.top_p - 0.9) < 1e-6
    assert dict(sampling.logit_bias) == {5: 1.5}
    assert (sampling.logprobs, sampling.top_logprobs, sampling.top_k) == (True, 3, 4)
    assert sampling.ignore_eos and list(sampling.stop_token_ids) == [9]
    assert messages[0].echo
    assert messages[0].hints.pattern == router_pb2.PATTERN_DISAGG and messages[0].hints.cache_aware


def test_unset_sampling_fields_stay_unset_for_router_defaults() -> None:
    sampling = completion_requests(CompletionRequest(model="m", prompt=[1, 2]), "c")[0].sampling
    assert not sampling.HasField("temperature") and not sampling.HasField("seed")
    assert sampling.max_tokens == 16  # OpenAI's completions default


def test_chat_prefers_max_completion_tokens_and_joins_text_parts() -> None:
    request = ChatCompletionRequest(
        model="m", max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=2,
        messages=[{"role": "developer", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}])
    message = chat_request(request, "chat")
    assert [(m.role, m.content) for m in message.chat.messages] == [("system", "be brief"),
                                                                   ("user", "ab")]
    assert message.sampling.max_tokens == 9 and message.sampling.top_logprobs == 2


def test_chat_rejects_image_parts_and_top_logprobs_without_logprobs() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", top_logprobs=2, messages=[{"role": "user", "content": "a"}])


def test_bad_logit_bias_is_a_400_on_logit_bias() -> None:
    for bias in ({"a": 1.0}, {"1": 101.0}, {"-1": 1.0}):
        with pytest.raises(GatewayError) as caught:
            completion_requests(CompletionRequest(model="m", prompt="a", logit_bias=bias), "c")
        assert (caught.value.status, caught.value.param) == (400, "logit_bias")


@pytest.mark.parametrize(("code", "status"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.UNAUTHENTICATED, 401),
    (grpc.StatusCode.NOT_FOUND, 404), (grpc.StatusCode.OUT_OF_RANGE, 400),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500),
    (grpc.StatusCode.DATA_LOSS, 500),
])
def test_grpc_codes_map_to_http_statuses(code: grpc.StatusCode, status: int) -> None:
    assert from_grpc(code, "m").status == status


def test_too_long_prompt_is_400_context_length_exceeded_as_openai_answers() -> None:
    error = from_code_number(11, "the prompt has 900 tokens; the context holds 512", "input")
    assert (error.status, error.param, error.kind.code) == (400, "input",
                                                            "context_length_exceeded")
    invalid = from_code_number(3, "bad temperature", "sampling.temperature")
    assert (invalid.status, invalid.kind.code) == (400, "invalid_request")


@pytest.mark.parametrize(("router_param", "completions", "chat"), [
    ("input", "prompt", "messages"), ("text", "prompt", "messages"),
    ("token_ids.ids", "prompt", "messages"), ("chat.messages", "prompt", "messages"),
    ("sampling.max_tokens", "max_tokens", "max_tokens"),
    ("sampling.top_logprobs", "logprobs", "top_logprobs"),
    ("sampling.temperature", "temperature", "temperature"), ("model", "model", "model"),
    ("max_tokens", "max_tokens", "max_tokens"), (None, None, None),
])
def test_router_params_are_named_in_the_clients_terms(router_param: str | None, completions: str | None,
                                                      chat: str | None) -> None:
    assert client_param(router_param, is_chat=False) == completions
    assert client_param(router_param, is_chat=True) == chat


def test_only_429_carries_retry_after_and_internal_detail_is_hidden() -> None:
    assert from_code_number(8, "busy").headers() == {"Retry-After": "1"}
    assert from_code_number(14, "down").headers() == {}
    assert "secret" not in from_code_number(13, "secret stack").message


def test_sse_events_are_single_line_json_and_end_with_done() -> None:
    frame = encode_event({"a": "x\ny"})
    assert frame == b'data: {"a":"x\\ny"}\n\n'
    assert parse_events(frame + DONE_EVENT) == [{"a": "x\ny"}, "[DONE]"]
    with pytest.raises(ValueError):
        parse_events(b"event: x\n\n")


def test_finish_reasons_have_openai_names() -> None:
    assert finish_reason_text(common_pb2.FINISH_REASON_STOP) == "stop"
    assert finish_reason_text(common_pb2.FINISH_REASON_LENGTH) == "length"


def test_api_key_checker_accepts_any_configured_key_only_as_bearer() -> None:
    checker = ApiKeyChecker(["k1", "k2"])
    checker.check("Bearer k2")
    for header in (None, "", "k1", "Basic k1", "Bearer k3", "Bearer "):
        with pytest.raises(GatewayError) as caught:
            checker.check(header)
        assert caught.value.status == 401
    ApiKeyChecker([]).check(None)  # no keys: open


def test_admission_limit_rejects_over_the_limit_and_frees_slots() -> None:
    limit = AdmissionLimit(1)
    with limit.slot():
        with pytest.raises(GatewayError) as caught:
            limit.acquire()
        assert caught.value.status == 429
    limit.acquire()
    assert limit.num_inflight == 1


def test_admission_counts_the_completions_a_request_carries() -> None:
    limit = AdmissionLimit(8, max_choices=100)
    with limit.slot(6):  # e.g. 3 prompts x n=2
        assert limit.num_inflight == 6
        with pytest.raises(GatewayError) as caught:
            limit.acquire(3)
        assert caught.value.status == 429
        limit.release(limit.acquire(2))
    assert limit.num_inflight == 0
    with limit.slot(50):  # more than the limit: capped, so it runs alone
        assert limit.num_inflight == 8
    with pytest.raises(GatewayError) as too_many:
        limit.acquire(101)
    assert too_many.value.status == 400 and "101 completions" in too_many.value.message


def test_settings_read_keys_from_env_and_reject_unknown_variables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MICROSERVING_GATEWAY_API_KEYS", "key-one, key-two")
    monkeypatch.setenv("MICROSERVING_GATEWAY_MAX_INFLIGHT", "3")
    settings = GatewaySettings()
    assert settings.all_api_keys() == ["key-one", "key-two"] and settings.max_inflight == 3
    assert "key-one" not in repr(settings)
    with pytest.raises(ValueError, match="MICROSERVING_GATEWAY_TYPO"):
        reject_unknown_env({"MICROSERVING_GATEWAY_TYPO": "1"})


@pytest.mark.parametrize("text", ["x", "", 'quote " and \\ backslash', "é ü 你好 🙂", "\n\t\x00",
                                  "line\u2028sep\x85nel\u2029"])
@pytest.mark.parametrize("reason", [None, "stop", "length"])
def test_chunk_template_renders_exactly_what_pydantic_renders(text: str,
                                                              reason: str | None) -> None:
    from gateway.protocol.chat import ChatChunkChoice, ChatCompletionChunk, ChatDelta
    from gateway.protocol.completion import CompletionChoice, CompletionResponse
    from gateway.sse import ChunkTemplate

    def completion(index: int, text: str, reason: str | None) -> CompletionResponse:
        return CompletionResponse(id="cmpl-1", created=5, model="m", choices=[
            CompletionChoice(index=index, text=text, finish_reason=reason)])  # type: ignore[arg-type]

    def chat(index: int, text: str, reason: str | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id="chat-1", created=5, model="m", choices=[ChatChunkChoice(
            index=index, delta=ChatDelta(content=text), finish_reason=reason)])  # type: ignore[arg-type]

    for build in (completion, chat):
        template = ChunkTemplate(build(ChunkTemplate.INDEX_MARKER, ChunkTemplate.TEXT_MARKER, None))
        fast = template.encode(3, text, reason)
        assert parse_events(fast) == parse_events(encode_event(build(3, text, reason)))
        if text.isascii() and "\x00" not in text:
            assert fast == encode_event(build(3, text, reason))
        # One event, one line, even for clients that split with str.splitlines().
        for event in (fast, encode_event(build(3, text, reason))):
            assert len(event.decode().rstrip("\n").splitlines()) == 1


def test_cli_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.cli import settings_from_args

    monkeypatch.setenv("MICROSERVING_GATEWAY_ROUTER", "10.0.0.1:1")
    monkeypatch.setenv("MICROSERVING_GATEWAY_MAX_INFLIGHT", "7")
    monkeypatch.setenv("MICROSERVING_GATEWAY_ROUTER_STREAMS", "5")
    settings = settings_from_args(["--router", "127.0.0.1:2", "--api-key", "a", "--api-key", "b",
                                   "--requests-per-router-stream", "3"])
    assert (settings.router, settings.max_inflight) == ("127.0.0.1:2", 7)
    assert (settings.router_streams, settings.requests_per_router_stream) == (5, 3)
    assert settings.all_api_keys() == ["a", "b"]


def test_cli_reports_a_busy_port_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from gateway.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["--port", str(port)]) == 1
    assert "cannot listen on" in capsys.readouterr().err
