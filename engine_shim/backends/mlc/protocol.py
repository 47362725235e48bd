"""MLC-LLM's microserving HTTP JSON, both ways: request bodies for prep_recv / remote_send /
start_generate (an OpenAI CompletionRequest plus the window fields, `user` = request id and a
non-null `debug_config`), and CompletionResponse chunks parsed into domain outputs."""

from __future__ import annotations

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
from engine_shim.engine.validation import TokenIds, id_list
from engine_shim.token_bytes import TokenBytes
from microserving.token_bytes import parse_display_token

MAX_MLC_LOGPROBS = 5  # MLC accepts logprobs 0..5 on completions

_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "preempt": FinishReason.PREEMPT,
}


def completion_body(
    model: str, request_id: str, token_ids: TokenIds, sampling: SamplingParams
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
        "prompt": id_list(token_ids),
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "n": sampling.n,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        # Always ask for logprobs: their tokens give back the exact token ids.
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


def _token_id(raw: bytes | None, token_bytes: TokenBytes) -> int | None:
    return None if raw is None else token_bytes.to_id(raw)


def _chat_shape(
    content: list[dict[str, Any]], token_bytes: TokenBytes
) -> list[TokenLogprob] | None:
    """`{"content": [{token, logprob, bytes, top_logprobs}]}`: ids from each entry's bytes."""
    logprobs: list[TokenLogprob] = []
    for entry in content:
        raw = None if entry.get("bytes") is None else bytes(entry["bytes"])
        token_id = _token_id(raw, token_bytes)
        if token_id is None or raw is None:
            return None
        top = tuple(
            TopLogprob(_token_id(bytes(t.get("bytes") or ()), token_bytes) or 0,
                       str(t.get("token", "")), float(t["logprob"]), bytes(t.get("bytes") or ()))
            for t in entry.get("top_logprobs") or ()
        )
        logprobs.append(
            TokenLogprob(token_id, str(entry.get("token", "")), float(entry["logprob"]), top, raw)
        )
    return logprobs


def _completion_shape(logprobs: dict[str, Any], token_bytes: TokenBytes) -> list[TokenLogprob] | None:
    """MLC's CompletionLogProbs: `tokens` (whole UTF-8, or `bytes:\\xNN` for part of a
    character) parallel to `token_logprobs` and `top_logprobs` maps."""
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [{}] * len(tokens)
    entries: list[TokenLogprob] = []
    for token, value, top_map in zip(tokens, values, tops, strict=False):
        raw = parse_display_token(str(token))
        token_id = _token_id(raw, token_bytes)
        if token_id is None:
            return None
        top = tuple(
            TopLogprob(_token_id(parse_display_token(t), token_bytes) or 0,
                       parse_display_token(t).decode("utf-8", "replace"), float(lp),
                       parse_display_token(t))
            for t, lp in (top_map or {}).items()
        )
        entries.append(TokenLogprob(token_id, raw.decode("utf-8", "replace"), float(value), top, raw))
    return entries


def _ids_only(choice_logprobs: dict[str, Any] | None, token_bytes: TokenBytes) -> list[int] | None:
    """The token ids of either shape without building logprob objects."""
    if not choice_logprobs:
        return None
    if "content" in choice_logprobs:
        raws = [entry.get("bytes") for entry in choice_logprobs["content"] or []]
        ids = [None if raw is None else token_bytes.to_id(bytes(raw)) for raw in raws]
    else:
        ids = [token_bytes.to_id(parse_display_token(str(t))) for t in choice_logprobs.get("tokens") or []]
    return None if any(i is None for i in ids) else [i for i in ids if i is not None]


def _logprobs(choice_logprobs: dict[str, Any] | None, token_bytes: TokenBytes) -> list[TokenLogprob] | None:
    if not choice_logprobs:
        return None
    if "content" in choice_logprobs:
        return _chat_shape(choice_logprobs["content"] or [], token_bytes)
    return _completion_shape(choice_logprobs, token_bytes)


def parse_choice(
    choice: dict[str, Any], token_bytes: TokenBytes, tokenizer_encode: Any, want_logprobs: bool
) -> Delta:
    text = str(choice.get("text") or "")
    raw_logprobs = choice.get("logprobs")
    logprobs: list[TokenLogprob] = []
    ids: list[int] | None
    if want_logprobs:
        parsed = _logprobs(raw_logprobs, token_bytes)
        ids = None if parsed is None else [lp.token_id for lp in parsed]
        logprobs = parsed or []
    else:  # the ids alone (the common, per-token case)
        ids = _ids_only(raw_logprobs, token_bytes)
    if ids is None:  # no logprobs, or tokens that map to no id: the best is to re-encode
        ids, logprobs = tokenizer_encode(text), []
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
