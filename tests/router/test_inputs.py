"""Input handling: text, token ids and chat are tokenized once; bad sampling values, lengths
and unknown models are refused with the field at fault."""

from __future__ import annotations

import grpc
import pytest

from engine_shim import validation as shim_validation
from engine_shim.convert import sampling_from_pb
from engine_shim.engine.api import InvalidRequestError
from microserving import limits
from microserving.tokenizer import Tokenizer
from microserving.v1 import common_pb2, router_pb2
from router.errors import RouterError
from router.prepared_request import check_sampling, prepare

TOKENIZER = Tokenizer.from_model("tiny")


def _new(**fields: object) -> router_pb2.NewRequest:
    fields.setdefault("request_id", "r")
    return router_pb2.NewRequest(**fields)  # type: ignore[arg-type]


def test_text_is_tokenized_with_bos() -> None:
    prepared = prepare(_new(text="hi"), TOKENIZER, "tiny", 1024)
    assert list(prepared.token_ids) == TOKENIZER.encode("hi")
    assert prepared.token_ids[0] == TOKENIZER.bos_token_id


def test_chat_is_rendered_with_the_template() -> None:
    chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="yo")])
    prepared = prepare(_new(chat=chat), TOKENIZER, "tiny", 1024)
    assert list(prepared.token_ids) == TOKENIZER.encode_chat([{"role": "user", "content": "yo"}])
    assert prepared.prompt_text.endswith("<|assistant|>")


def test_token_ids_pass_through() -> None:
    prepared = prepare(_new(token_ids=router_pb2.TokenIds(ids=[1, 2, 3])), TOKENIZER, "tiny", None)
    assert prepared.token_ids == (1, 2, 3)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"text": "x", "sampling": common_pb2.SamplingParams(temperature=-1)}, "sampling.temperature"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(top_p=0)}, "sampling.top_p"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(max_tokens=0)}, "sampling.max_tokens"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(n=0)}, "sampling.n"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(presence_penalty=3)}, "sampling.presence_penalty"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(logit_bias={5: 101})}, "sampling.logit_bias"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(top_logprobs=21)}, "sampling.top_logprobs"),
        ({"token_ids": router_pb2.TokenIds(ids=[10**6])}, "token_ids.ids"),
        ({"token_ids": router_pb2.TokenIds()}, "token_ids.ids"),
        ({}, "input"),
        ({"text": ""}, "text"),
        ({"chat": router_pb2.ChatMessages()}, "chat.messages"),
        ({"request_id": "x" * 257, "text": "x"}, "request_id"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(stop=["s" * 257])}, "sampling.stop"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(stop=["s"] * 17)}, "sampling.stop"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(stop_token_ids=[5] * 257)},
         "sampling.stop_token_ids"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(logit_bias=dict.fromkeys(range(1025), 1.0))},
         "sampling.logit_bias"),
    ],
)
def test_invalid_input_is_refused_with_its_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(RouterError) as caught:
        prepare(_new(**fields), TOKENIZER, "tiny", 1024)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.param == param


def test_a_prompt_longer_than_the_context_is_out_of_range() -> None:
    with pytest.raises(RouterError) as caught:
        prepare(_new(text="x" * 2000), TOKENIZER, "tiny", 1024)
    assert (caught.value.code, caught.value.param) == (grpc.StatusCode.OUT_OF_RANGE, "input")


def test_a_prompt_plus_max_tokens_over_the_context_is_out_of_range() -> None:
    with pytest.raises(RouterError) as caught:
        prepare(_new(text="x", sampling=common_pb2.SamplingParams(max_tokens=1023)), TOKENIZER, "tiny", 1024)
    assert (caught.value.code, caught.value.param) == (grpc.StatusCode.OUT_OF_RANGE, "sampling.max_tokens")
    assert "maximum context length is 1024" in caught.value.message


def test_unknown_model_is_not_found() -> None:
    with pytest.raises(RouterError) as caught:
        prepare(_new(text="x", model="gpt-9"), TOKENIZER, "tiny", 1024)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND


_LIMITS = ("n", "top_logprobs", "stop", "stop string", "stop_token_ids", "logit_bias", "cache_salt")


def _sizes(past: str | None) -> common_pb2.SamplingParams:
    """Every size limit of microserving/limits.py reached, and the one named `past` passed."""
    def size(name: str, limit: int) -> int:
        return limit + 1 if name == past else limit

    return common_pb2.SamplingParams(
        n=size("n", limits.MAX_CHOICES), top_logprobs=size("top_logprobs", limits.MAX_TOP_LOGPROBS),
        logprobs=True,
        stop=["s" * size("stop string", limits.MAX_STOP_STRING_CHARS)] * size("stop", limits.MAX_STOP_STRINGS),
        stop_token_ids=[5] * size("stop_token_ids", limits.MAX_STOP_TOKEN_IDS),
        logit_bias=dict.fromkeys(range(size("logit_bias", limits.MAX_LOGIT_BIAS_ENTRIES)), 1.0),
        cache_salt="c" * size("cache_salt", limits.MAX_CACHE_SALT_CHARS),
    )


@pytest.mark.parametrize("past", [None, *_LIMITS])
def test_the_router_and_the_shim_agree_on_every_size_limit(past: str | None) -> None:
    """What the router lets through, the shim takes (a request never fails at an engine for
    a size the router could have refused: it would have cost a reservation on D and a send on
    P first), and one past any limit both refuse."""
    sampling = _sizes(past)
    vocab_size = limits.MAX_LOGIT_BIAS_ENTRIES + 8  # every biased id a token
    router_refused = shim_refused = False
    try:
        check_sampling(sampling, vocab_size)
    except RouterError:
        router_refused = True
    try:
        shim_validation.check_sampling(sampling_from_pb(sampling), vocab_size)
    except InvalidRequestError:
        shim_refused = True
    assert (router_refused, shim_refused) == (past is not None, past is not None)
