"""MLC-LLM's microserving HTTP JSON, both ways: request bodies for prep_recv / remote_send /
start_generate (an OpenAI CompletionRequest plus the window fields, `user` = request id and a
non-null `debug_config`), and CompletionResponse chunks parsed into domain outputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine_shim.engine.api import (
    Delta,
    FinishReason,
    InvalidRequestError,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from engine_shim.token_bytes import TokenBytes

MAX_MLC_LOGPROBS = 5  # MLC accepts logprobs 0..5 on completions

_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "preempt": FinishReason.PREEMPT,
}


def completion_body(
    model: str, request_id: str, token_ids: Sequence[int], sampling: SamplingParams
) -> dict[str, Any]:
    """The CompletionRequest every microserving call carries (MLC sends the whole request)."""
    if sampling.top_k:
        raise InvalidRequestError("the mlc backend does not support top_k")
    if sampling.stop_token_ids:
        raise InvalidRequestError("the mlc backend does not support stop_token_ids")
    if sampling.top_logprobs > MAX_MLC_LOGPROBS:
        raise InvalidRequestError(f"the mlc backend supports top_logprobs <= {MAX_MLC_LOGPROBS}")
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(token_ids),
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "n": sampling.n,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        # Always ask for logprobs: their `bytes` give back the exact token ids.
        "logprobs": sampling.top_logprobs,
        "user": request_id,
        "debug_config": {"ignore_eos": True} if sampling.ignore_eos else {},
    }
    if sampling.max_tokens is not None:
        body["max_tokens"] = sampling.max_tokens
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in sampling.logit_bias.items()}
    return body


def prep_recv_body(base: dict[str, Any], end: int) -> dict[str, Any]:
    return {**base, "end": end}


def remote_send_body(
    base: dict[str, Any], begin: int, end: int, kv_addr_info: str, recv_rank: int
) -> dict[str, Any]:
    return {
        **base,
        "begin": begin,
        "end": end,
        "kv_addr_info": kv_addr_info,
        "recv_rank": recv_rank,
    }


def start_generate_body(base: dict[str, Any], begin: int) -> dict[str, Any]:
    return {**base, "begin": begin, "stream": True, "stream_options": {"include_usage": True}}


def _token_id(entry: dict[str, Any], token_bytes: TokenBytes) -> int | None:
    raw = entry.get("bytes")
    if raw is None:
        return None
    return token_bytes.to_id(bytes(raw))


def _ids(content: list[dict[str, Any]], token_bytes: TokenBytes) -> list[int]:
    ids = []
    for entry in content:
        token_id = _token_id(entry, token_bytes)
        if token_id is None:
            raise ValueError("MLC logprobs entry without token bytes")
        ids.append(token_id)
    return ids


def _logprobs(
    content: list[dict[str, Any]], token_bytes: TokenBytes
) -> tuple[list[int], list[TokenLogprob]]:
    ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    for entry in content:
        token_id = _token_id(entry, token_bytes)
        if token_id is None:
            raise ValueError("MLC logprobs entry without token bytes")
        ids.append(token_id)
        top = tuple(
            TopLogprob(_token_id(t, token_bytes) or 0, str(t.get("token", "")), float(t["logprob"]))
            for t in entry.get("top_logprobs") or ()
        )
        logprobs.append(
            TokenLogprob(token_id, str(entry.get("token", "")), float(entry["logprob"]), top)
        )
    return ids, logprobs


def parse_choice(
    choice: dict[str, Any], token_bytes: TokenBytes, tokenizer_encode: Any, want_logprobs: bool
) -> Delta:
    text = str(choice.get("text") or "")
    content = (choice.get("logprobs") or {}).get("content")
    logprobs: list[TokenLogprob] = []
    if content is not None and not want_logprobs:  # the ids alone (the common, per-token case)
        ids = _ids(content, token_bytes)
    elif content is not None:
        ids, logprobs = _logprobs(content, token_bytes)
    else:  # an MLC without logprobs: the best we can do is to re-encode the text
        ids = tokenizer_encode(text)
    reason = choice.get("finish_reason")
    finish = None if reason is None else _FINISH.get(str(reason), FinishReason.ERROR)
    return Delta(
        index=int(choice.get("index", 0)),
        token_ids=tuple(ids),
        text=text,
        logprobs=tuple(logprobs) if want_logprobs else (),
        finish_reason=finish,
    )


def parse_usage(usage: dict[str, Any], cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        cached_tokens=cached_tokens,
    )
