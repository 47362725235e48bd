"""Input handling: turns a Router NewRequest into token ids (tokenized once, so every engine
sees the same ids and windows) and checks sampling values and length up front.

Raises InvalidRequestError (with the field at fault) or ModelNotFoundError; never asserts.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from dataclasses import dataclass

from microserving import limits
from microserving.tokenizer import Tokenizer
from microserving.v1 import common_pb2, router_pb2
from router.errors import ContextLengthError, InvalidRequestError, ModelNotFoundError

# Inputs from this many characters are tokenized in a worker thread, this many at once.
OFF_LOOP_MIN_CHARS = 16_384
MAX_OFF_LOOP_TOKENIZATIONS = 2
_off_loop_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary())


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request: the prompt as the engines will see it, plus what to run."""

    request_id: str
    model: str
    token_ids: tuple[int, ...]
    prompt_text: str
    sampling: common_pb2.SamplingParams
    hints: router_pb2.PatternHints
    echo: bool


def check_request_id(request_id: str) -> None:
    if not 1 <= len(request_id) <= limits.MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(f"request_id must hold 1..{limits.MAX_REQUEST_ID_CHARS} characters",
                                  param="request_id")


def prepare(
    request: router_pb2.NewRequest,
    tokenizer: Tokenizer,
    model_id: str,
    max_context_length: int | None,
) -> PreparedRequest:
    """Validate `request` and tokenize its prompt."""
    check_request_id(request.request_id)
    if request.model and request.model != model_id:
        raise ModelNotFoundError(f"model {request.model!r} is not served here", param="model")
    vocab_size = tokenizer.vocab_size  # asked once: the tokenizers backend call is not free
    check_sampling(request.sampling, vocab_size)
    check_size(request, tokenizer, max_context_length)
    token_ids, text = _tokenize(request, tokenizer, vocab_size)
    check_length(len(token_ids), request.sampling, max_context_length)
    return PreparedRequest(
        request_id=request.request_id,
        model=model_id,
        token_ids=tuple(token_ids),
        prompt_text=text,
        sampling=request.sampling,
        hints=request.hints,
        echo=request.echo,
    )


async def prepare_off_loop(
    request: router_pb2.NewRequest,
    tokenizer: Tokenizer,
    model_id: str,
    max_context_length: int | None,
) -> PreparedRequest:
    """`prepare`, in a worker thread when the input is long (the tokenizer lets go of the GIL
    for long texts), so a big prompt never holds the event loop and the other streams; at
    most a few such tokenizations run at once."""
    if input_chars(request) < OFF_LOOP_MIN_CHARS:
        return prepare(request, tokenizer, model_id, max_context_length)
    loop = asyncio.get_running_loop()
    slots = _off_loop_slots.setdefault(loop, asyncio.Semaphore(MAX_OFF_LOOP_TOKENIZATIONS))
    async with slots:
        return await asyncio.to_thread(prepare, request, tokenizer, model_id, max_context_length)


def input_chars(request: router_pb2.NewRequest) -> int:
    """Characters (or token ids) of the request's input; costs no pass over the text."""
    kind = request.WhichOneof("input")
    if kind == "text":
        return len(request.text)
    if kind == "token_ids":
        return len(request.token_ids.ids)
    if kind == "chat":
        return sum(len(m.content) + len(m.role) for m in request.chat.messages)
    return 0


def check_size(request: router_pb2.NewRequest, tokenizer: Tokenizer, max_context_length: int | None) -> None:
    """Refuses an input that cannot fit the context whatever it tokenizes to, before
    tokenizing: more token ids than the context, or more characters than the context's
    tokens can spell (each token spells at most `max_token_chars`)."""
    if max_context_length is None:
        return
    size = input_chars(request)
    if request.WhichOneof("input") == "token_ids":
        if size >= max_context_length:
            raise ContextLengthError(
                f"the prompt has {size} tokens; the context holds {max_context_length}", param="input")
        return
    max_chars = max_context_length * tokenizer.max_token_chars
    if size > max_chars:
        raise ContextLengthError(
            f"the prompt has {size} characters, more than any prompt that fits the context of "
            f"{max_context_length} tokens", param="input")


def _tokenize(request: router_pb2.NewRequest, tokenizer: Tokenizer, vocab_size: int) -> tuple[list[int], str]:
    kind = request.WhichOneof("input")
    if kind == "text":
        if not request.text:
            raise InvalidRequestError("text must not be empty", param="text")
        return tokenizer.encode(request.text), request.text
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidRequestError("token_ids must not be empty", param="token_ids.ids")
        if min(ids) < 0 or max(ids) >= vocab_size:  # C loops: a long prompt costs microseconds
            raise InvalidRequestError(f"token ids must lie in [0, {vocab_size})", param="token_ids.ids")
        # The text is only sent back for echo; decoding it for every request costs time.
        return ids, tokenizer.decode(ids, skip_special_tokens=False) if request.echo else ""
    if kind == "chat":
        return _tokenize_chat(request.chat, tokenizer)
    raise InvalidRequestError("one of text, token_ids or chat is required", param="input")


def _tokenize_chat(chat: router_pb2.ChatMessages, tokenizer: Tokenizer) -> tuple[list[int], str]:
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_prompt)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="chat.messages") from exc
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise InvalidRequestError("the chat renders to an empty prompt", param="chat.messages")
    return ids, text


def _check_range(value: float, low: float, high: float, param: str) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidRequestError(f"{param.split('.')[-1]} must lie in [{low}, {high}]", param=param)


def check_sampling(sampling: common_pb2.SamplingParams, vocab_size: int) -> None:
    """OpenAI's ranges for every sampling value."""
    if sampling.HasField("temperature"):
        _check_range(sampling.temperature, 0.0, 2.0, "sampling.temperature")
    if sampling.HasField("top_p") and not (0.0 < sampling.top_p <= 1.0):
        raise InvalidRequestError("top_p must lie in (0, 1]", param="sampling.top_p")
    if sampling.top_k < 0:
        raise InvalidRequestError("top_k must be >= 0", param="sampling.top_k")
    if sampling.HasField("max_tokens") and sampling.max_tokens < 1:
        raise InvalidRequestError("max_tokens must be >= 1", param="sampling.max_tokens")
    if sampling.HasField("n") and not 1 <= sampling.n <= limits.MAX_CHOICES:
        raise InvalidRequestError(f"n must lie in [1, {limits.MAX_CHOICES}]", param="sampling.n")
    _check_range(sampling.frequency_penalty, -2.0, 2.0, "sampling.frequency_penalty")
    _check_range(sampling.presence_penalty, -2.0, 2.0, "sampling.presence_penalty")
    if len(sampling.logit_bias) > limits.MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"logit_bias takes at most {limits.MAX_LOGIT_BIAS_ENTRIES} entries",
                                  param="sampling.logit_bias")
    for token_id, bias in sampling.logit_bias.items():
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError("logit_bias keys must be token ids", param="sampling.logit_bias")
        _check_range(bias, -100.0, 100.0, "sampling.logit_bias")
    if not 0 <= sampling.top_logprobs <= limits.MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must lie in [0, {limits.MAX_TOP_LOGPROBS}]",
                                  param="sampling.top_logprobs")
    if len(sampling.stop) > limits.MAX_STOP_STRINGS or any(
            not 1 <= len(s) <= limits.MAX_STOP_STRING_CHARS for s in sampling.stop):
        raise InvalidRequestError(f"stop takes up to {limits.MAX_STOP_STRINGS} strings of 1.."
                                  f"{limits.MAX_STOP_STRING_CHARS} characters", param="sampling.stop")
    if len(sampling.cache_salt) > limits.MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(f"cache_salt takes at most {limits.MAX_CACHE_SALT_CHARS} characters",
                                  param="sampling.cache_salt")
    if len(sampling.stop_token_ids) > limits.MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"stop_token_ids takes at most {limits.MAX_STOP_TOKEN_IDS} ids",
                                  param="sampling.stop_token_ids")
    if any(not 0 <= t < vocab_size for t in sampling.stop_token_ids):
        raise InvalidRequestError("stop_token_ids must be token ids", param="sampling.stop_token_ids")


def check_length(
    num_prompt_tokens: int, sampling: common_pb2.SamplingParams, max_context_length: int | None
) -> None:
    """The prompt plus the tokens asked for must fit the model's context."""
    if max_context_length is None:
        return  # no engine has reported yet; the engine checks again
    # Worded as OpenAI words it: clients (litellm) recognise "maximum context length".
    if num_prompt_tokens >= max_context_length:
        raise ContextLengthError(
            f"This model's maximum context length is {max_context_length} tokens; the prompt "
            f"has {num_prompt_tokens} tokens.",
            param="input",
        )
    if sampling.HasField("max_tokens") and num_prompt_tokens + sampling.max_tokens > max_context_length:
        raise ContextLengthError(
            f"This model's maximum context length is {max_context_length} tokens; you requested "
            f"{num_prompt_tokens + sampling.max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {sampling.max_tokens} for the completion).",
            param="sampling.max_tokens",
        )
