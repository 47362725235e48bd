"""Checks on every public engine call, run before any state changes. Windows follow MLC's
semantics: Python-style negative indices, so end=-1 means len(prompt) - 1."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .api import InvalidRequestError, SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0


def check_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id must be a non-empty string")
    return request_id


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    ids = list(token_ids)
    if not ids:
        raise InvalidRequestError("prompt is empty")
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool):
            raise InvalidRequestError("token ids must be integers")
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(f"token id {token} outside the vocabulary [0, {vocab_size})")
    return ids


def normalize_index(index: int, length: int, name: str) -> int:
    if not isinstance(index, int) or isinstance(index, bool):
        raise InvalidRequestError(f"{name} must be an integer")
    return index + length if index < 0 else index


def check_prep_recv_end(end: int, length: int) -> int:
    e = normalize_index(end, length, "end")
    if not 0 <= e < length:
        raise InvalidRequestError(f"prep_recv needs 0 <= end < len(prompt)={length}, got end={end}")
    return e


def check_remote_send_window(begin: int, end: int, length: int) -> tuple[int, int]:
    b = normalize_index(begin, length, "begin")
    e = normalize_index(end, length, "end")
    if not 0 <= b < e < length:
        raise InvalidRequestError(
            f"remote_send needs 0 <= begin < end < len(prompt)={length}, got [{begin}, {end})"
        )
    return b, e


def check_start_generate_begin(begin: int, length: int) -> int:
    b = normalize_index(begin, length, "begin")
    if not 0 <= b < length:
        raise InvalidRequestError(
            f"start_generate needs 0 <= begin < len(prompt)={length}, got begin={begin}"
        )
    return b


MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt: str) -> str:
    if not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters")
    return salt


def check_sampling(
    params: SamplingParams, vocab_size: int, max_context_length: int, num_prompt_tokens: int
) -> int:
    """Validate sampling values; returns the effective max_tokens."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("sampling must be a SamplingParams")
    check_cache_salt(params.cache_salt)
    _check_finite(params.temperature, "temperature")
    if params.temperature < 0:
        raise InvalidRequestError("temperature must be >= 0")
    _check_finite(params.top_p, "top_p")
    if not 0 < params.top_p <= 1:
        raise InvalidRequestError("top_p must be in (0, 1]")
    if params.top_k < 0:
        raise InvalidRequestError("top_k must be >= 0 (0 disables it)")
    if params.n < 1:
        raise InvalidRequestError("n must be >= 1")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(params, name)
        _check_finite(value, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidRequestError(f"{name} must be in [-2, 2]")
    for token, bias in params.logit_bias.items():
        if not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError(f"logit_bias token {token} outside the vocabulary")
        _check_finite(bias, "logit_bias")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequestError("logit_bias values must be in [-100, 100]")
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    for token in params.stop_token_ids:
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(f"stop token id {token} outside the vocabulary")
    if any(not isinstance(s, str) or not s for s in params.stop):
        raise InvalidRequestError("stop strings must be non-empty strings")
    return _check_length(params, max_context_length, num_prompt_tokens)


def _check_length(params: SamplingParams, max_context_length: int, num_prompt_tokens: int) -> int:
    room = max_context_length - num_prompt_tokens
    if room < 1:
        raise InvalidRequestError(
            f"prompt of {num_prompt_tokens} tokens leaves no room in the context of "
            f"{max_context_length}"
        )
    if params.max_tokens is None:
        return room
    if params.max_tokens < 1:
        raise InvalidRequestError("max_tokens must be >= 1")
    if params.max_tokens > room:
        raise InvalidRequestError(
            f"prompt ({num_prompt_tokens}) + max_tokens ({params.max_tokens}) exceeds the "
            f"context length {max_context_length}"
        )
    return params.max_tokens


def _check_finite(value: float, name: str) -> None:
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number")
