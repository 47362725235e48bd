"""Checks every call must pass before an engine sees it: request ids, windows (MLC's rules,
negative indices normalised), token ids, sampling values and sizes. Pure functions that raise
the engine's domain errors."""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine_shim.engine.api import InvalidRequestError, SamplingParams

MAX_REQUEST_ID_CHARS = 256
MAX_CHOICES = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOP_LOGPROBS = 20
MAX_KV_ADDR_INFO_BYTES = 1024 * 1024


def check_request_id(request_id: str) -> None:
    if not 1 <= len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}"
        )
    if not all(" " <= ch <= "~" for ch in request_id):
        raise InvalidRequestError("request_id must be printable ASCII")


def check_token_ids(token_ids: Sequence[int], vocab_size: int, max_prompt_tokens: int) -> None:
    if not token_ids:
        raise InvalidRequestError("prompt is empty")
    if len(token_ids) > max_prompt_tokens:
        raise InvalidRequestError(f"prompt has {len(token_ids)} tokens, limit {max_prompt_tokens}")
    low, high = min(token_ids), max(token_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidRequestError(f"token id {bad} outside the vocabulary [0, {vocab_size})")


def _normalise(index: int, num_tokens: int) -> int:
    return index + num_tokens if index < 0 else index


def prep_recv_end(end: int, num_tokens: int) -> int:
    """MLC: 0 <= end < len(prompt) after normalisation."""
    norm = _normalise(end, num_tokens)
    if not 0 <= norm < num_tokens:
        raise InvalidRequestError(
            f"end={end} outside [0, {num_tokens}) for a prompt of {num_tokens}"
        )
    return norm


def remote_send_window(begin: int, end: int, num_tokens: int) -> tuple[int, int]:
    """MLC: 0 <= begin < end < len(prompt) after normalisation."""
    norm_begin, norm_end = _normalise(begin, num_tokens), _normalise(end, num_tokens)
    if not 0 <= norm_begin < norm_end < num_tokens:
        raise InvalidRequestError(
            f"window [begin={begin}, end={end}) invalid for a prompt of {num_tokens}: "
            "need 0 <= begin < end < len(prompt)"
        )
    return norm_begin, norm_end


def start_generate_begin(begin: int, num_tokens: int) -> int:
    """MLC: 0 <= begin < len(prompt) after normalisation."""
    norm = _normalise(begin, num_tokens)
    if not 0 <= norm < num_tokens:
        raise InvalidRequestError(f"begin={begin} outside [0, {num_tokens})")
    return norm


def check_context(num_prompt_tokens: int, sampling: SamplingParams, max_context: int) -> None:
    needed = num_prompt_tokens + (sampling.max_tokens or 0)
    if num_prompt_tokens >= max_context or needed > max_context:
        raise InvalidRequestError(
            f"prompt ({num_prompt_tokens}) + max_tokens ({sampling.max_tokens or 0}) exceeds "
            f"the context length {max_context}"
        )


def check_sampling(sampling: SamplingParams, vocab_size: int) -> None:
    _check_range("temperature", sampling.temperature, 0.0, math.inf, low_open=False)
    _check_range("top_p", sampling.top_p, 0.0, 1.0, low_open=True)
    _check_range("frequency_penalty", sampling.frequency_penalty, -2.0, 2.0, low_open=False)
    _check_range("presence_penalty", sampling.presence_penalty, -2.0, 2.0, low_open=False)
    if sampling.top_k < 0:
        raise InvalidRequestError(f"top_k must be >= 0, got {sampling.top_k}")
    if sampling.max_tokens is not None and sampling.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
    if not 1 <= sampling.n <= MAX_CHOICES:
        raise InvalidRequestError(f"n must be in [1, {MAX_CHOICES}], got {sampling.n}")
    if not 0 <= sampling.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    _check_stops(sampling, vocab_size)
    _check_logit_bias(sampling, vocab_size)


def _check_range(name: str, value: float, low: float, high: float, *, low_open: bool) -> None:
    below = value <= low if low_open else value < low
    if math.isnan(value) or below or value > high:
        bracket = "(" if low_open else "["
        raise InvalidRequestError(f"{name} must be in {bracket}{low}, {high}], got {value}")


def _check_stops(sampling: SamplingParams, vocab_size: int) -> None:
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings")
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in sampling.stop):
        raise InvalidRequestError(f"stop strings must be 1..{MAX_STOP_STRING_CHARS} characters")
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
    if any(not 0 <= t < vocab_size for t in sampling.stop_token_ids):
        raise InvalidRequestError("stop token id outside the vocabulary")


def _check_logit_bias(sampling: SamplingParams, vocab_size: int) -> None:
    if len(sampling.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"at most {MAX_LOGIT_BIAS_ENTRIES} logit_bias entries")
    for token_id, bias in sampling.logit_bias.items():
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"logit_bias token id {token_id} outside the vocabulary")
        if math.isnan(bias) or not -100.0 <= bias <= 100.0:
            raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias}")


def check_kv_addr_info(kv_addr_info: bytes) -> None:
    if not kv_addr_info:
        raise InvalidRequestError("kv_addr_info is empty")
    if len(kv_addr_info) > MAX_KV_ADDR_INFO_BYTES:
        raise InvalidRequestError("kv_addr_info is too large")
