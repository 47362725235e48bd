"""Checks on every public engine call, run before any state changes, and the one source of
MLC's window and sampling rules (the shim's own checks, engine_shim/validation.py, use these).
Windows follow MLC's semantics: Python-style negative indices, so end=-1 means
len(prompt) - 1."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from microserving.limits import MAX_CACHE_SALT_CHARS, MAX_TOP_LOGPROBS

from .api import Continuation, InvalidRequestError, SamplingParams

MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0


def check_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id must be a non-empty string")
    return request_id


# A prompt's ids as callers hand them over: a sequence of ints, or an integer array (the shim
# passes the ids of a gRPC message as one, read from the message in one copy).
TokenIds: TypeAlias = Sequence[int] | npt.NDArray[np.integer]


def own_ids(token_ids: TokenIds) -> list[int] | npt.NDArray[np.integer]:
    """A copy of the ids that the caller cannot change under the engine: an integer array
    stays one (it crosses to the core's process as one buffer, and check_token_ids checks
    it by range alone), anything else becomes a list."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.copy()
    return list(token_ids)


def id_list(token_ids: TokenIds) -> list[int]:
    """The ids as a list of plain ints (an array's as tolist() gives them)."""
    if isinstance(token_ids, np.ndarray):
        ids: list[int] = token_ids.tolist()
        return ids
    return list(token_ids)


def check_token_ids(token_ids: TokenIds, vocab_size: int) -> list[int]:
    """The ids as a list, each a plain int in [0, vocab_size). Checked with C-level passes
    (the types in one set, then min and max): a per-token Python loop took twice as long
    (0.71 against 0.34 ms for 8,176 ids) in the engine core's loop, on every request. An
    integer array needs no type pass (it cannot hold a bool or a float): its range, then
    tolist(), took 0.14 ms for 8,176 ids against 0.35 for the list's checks, and it crosses
    the pipe to the core as one buffer (unpickling the list took 0.13 ms more)."""
    if isinstance(token_ids, np.ndarray):
        return _checked_array(token_ids, vocab_size)
    ids = list(token_ids)
    if not ids:
        raise InvalidRequestError("prompt is empty")
    if set(map(type, ids)) != {int}:  # bool is a subclass of int, and not a token id
        raise InvalidRequestError("token ids must be integers")
    check_vocab_range(min(ids), max(ids), vocab_size)
    return ids


def _checked_array(token_ids: npt.NDArray[np.integer], vocab_size: int) -> list[int]:
    if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":  # "b" (bool), "f" refused
        raise InvalidRequestError("token ids must be integers")
    if not token_ids.size:
        raise InvalidRequestError("prompt is empty")
    check_vocab_range(int(token_ids.min()), int(token_ids.max()), vocab_size)
    return id_list(token_ids)


def check_vocab_range(low: int, high: int, vocab_size: int) -> None:
    """The smallest and largest id of a prompt lie in [0, vocab_size)."""
    if low < 0 or high >= vocab_size:
        token = low if low < 0 else high
        raise InvalidRequestError(f"token id {token} outside the vocabulary [0, {vocab_size})")


def normalize_index(index: int, length: int, name: str) -> int:
    if not isinstance(index, int) or isinstance(index, bool):
        raise InvalidRequestError(f"{name} must be an integer")
    return index + length if index < 0 else index


def check_prep_recv_end(end: int, length: int, whole_prompt: bool = False) -> int:
    """MLC: 0 <= end < len(prompt) after normalisation; `whole_prompt` (a reservation for a
    start that continues from the sender's first tokens): end = len(prompt) too."""
    e = normalize_index(end, length, "end")
    if not 0 <= e <= (length if whole_prompt else length - 1):
        raise InvalidRequestError(
            f"end={end} outside [0, {length}{']' if whole_prompt else ')'} for a prompt of {length}")
    return e


def check_remote_send_window(
    begin: int, end: int, length: int, samples_first: bool = False
) -> tuple[int, int]:
    """MLC: 0 <= begin < end < len(prompt) after normalisation; `samples_first` (the sender
    computes the whole prompt anyway): end = len(prompt) too."""
    b = normalize_index(begin, length, "begin")
    e = normalize_index(end, length, "end")
    if not 0 <= b < e <= (length if samples_first else length - 1):
        raise InvalidRequestError(
            f"window [begin={begin}, end={end}) invalid for a prompt of {length}: need 0 <= "
            f"begin < end {'<=' if samples_first else '<'} len(prompt)"
        )
    return b, e


def check_start_generate_begin(begin: int, length: int, continues: bool = False) -> int:
    """MLC: 0 <= begin < len(prompt) after normalisation; `continues` (the choices go on from
    tokens sampled elsewhere, which are computed here): begin = len(prompt) too."""
    b = normalize_index(begin, length, "begin")
    if not 0 <= b <= (length if continues else length - 1):
        raise InvalidRequestError(f"begin={begin} outside [0, {length}{']' if continues else ')'}")
    return b


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
    check_sampling_values(params, vocab_size)
    return check_context_length(num_prompt_tokens, params.max_tokens, max_context_length)


def check_sampling_values(params: SamplingParams, vocab_size: int) -> None:
    """MLC's ranges for each sampling value (OpenAI's where MLC follows them)."""
    _check_range("temperature", params.temperature, 0.0, math.inf, low_open=False)
    _check_range("top_p", params.top_p, 0.0, 1.0, low_open=True)
    for name in ("frequency_penalty", "presence_penalty"):
        _check_range(name, getattr(params, name), -MAX_PENALTY, MAX_PENALTY, low_open=False)
    if params.top_k < 0:
        raise InvalidRequestError(f"top_k must be >= 0, got {params.top_k}")
    if params.max_tokens is not None and params.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be >= 1, got {params.max_tokens}")
    if params.n < 1:
        raise InvalidRequestError(f"n must be >= 1, got {params.n}")
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    _check_stops(params, vocab_size)
    _check_logit_bias(params, vocab_size)


def check_continuations(continuations: Sequence[Continuation], n: int, vocab_size: int) -> None:
    """None, or one per choice in index order, each with at least one token of the
    vocabulary."""
    if not continuations:
        return
    if len(continuations) != n:
        raise InvalidRequestError(f"continuations: {len(continuations)} given for n={n} choices")
    for position, (index, token_ids, state) in enumerate(continuations):
        if index != position:
            raise InvalidRequestError(f"continuations must be in index order: {index} at {position}")
        if not token_ids:
            raise InvalidRequestError(f"continuation {index} has no token")
        if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
            raise InvalidRequestError(f"continuation {index}: token id outside the vocabulary")
        if not isinstance(state, bytes):
            raise InvalidRequestError(f"continuation {index}: sampler_state must be bytes")


def check_context_length(
    num_prompt_tokens: int, max_tokens: int | None, max_context_length: int
) -> int:
    """The prompt and `max_tokens` fit the context; returns the effective max_tokens (the
    room left when it is None)."""
    room = max_context_length - num_prompt_tokens
    if room < 1 or (max_tokens is not None and max_tokens > room):
        raise InvalidRequestError(
            f"prompt ({num_prompt_tokens}) + max_tokens ({max_tokens or 0}) exceeds "
            f"the context length {max_context_length}"
        )
    return room if max_tokens is None else max_tokens


def _check_range(name: str, value: float, low: float, high: float, *, low_open: bool) -> None:
    # Not finite: NaN passes every comparison, and MLC's sampler cannot use an infinity.
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number")
    below = value <= low if low_open else value < low
    if below or value > high:
        bracket = "(" if low_open else "["
        raise InvalidRequestError(f"{name} must be in {bracket}{low}, {high}], got {value}")


def _check_stops(params: SamplingParams, vocab_size: int) -> None:
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise InvalidRequestError("stop token id outside the vocabulary")
    if any(not isinstance(s, str) or not s for s in params.stop):
        raise InvalidRequestError("stop strings must be non-empty strings")


def _check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    for token_id, bias in params.logit_bias.items():
        if not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"logit_bias token id {token_id} outside the vocabulary")
        if not isinstance(bias, int | float) or math.isnan(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias}")
