"""MLC-LLM's HTTP request and response JSON (OpenAI CompletionRequest / CompletionResponse plus
the microserving window fields), as pydantic models and builders."""

from __future__ import annotations

import time
from typing import Any

from engine_shim.engine.api import Delta, InvalidRequestError, SamplingParams, Usage
from engine_shim.token_bytes import TokenBytes
from microserving.lenient_model import LenientModel
from microserving.token_bytes import TextOffsets, display_token

MAX_COMPLETION_LOGPROBS = 5  # MLC's (and OpenAI's) limit for /v1/completions


class StreamOptions(LenientModel):
    include_usage: bool | None = False


class DebugConfig(LenientModel):
    """MLC's debug_config. MLC's router always sends every field (`model_dump()`); the ones
    this engine cannot honour are refused when set, never ignored."""

    ignore_eos: bool = False
    pinned_system_prompt: bool = False
    special_request: str | None = None
    grammar_execution_mode: str = "jump_forward"  # no grammar here, so either mode is moot
    disagg_config: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.pinned_system_prompt:
            raise InvalidRequestError("debug_config.pinned_system_prompt is not supported")
        if self.special_request is not None:
            raise InvalidRequestError(
                f"debug_config.special_request {self.special_request!r} is not supported"
            )
        if self.disagg_config is not None:
            raise InvalidRequestError(
                "debug_config.disagg_config is set by the /microserving/* routes, not by callers"
            )


class CompletionRequest(LenientModel):
    model: str | None = None
    prompt: str | list[int]
    best_of: int = 1
    echo: bool = False
    # MLC types the penalties Optional and its router forwards `model_dump()`, so null arrives.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    debug_config: DebugConfig | None = None

    def check_supported(self) -> None:
        """Refuses what MLC accepts but this engine cannot do, rather than ignoring it."""
        if self.best_of != 1 or self.echo or self.suffix:
            raise InvalidRequestError("best_of, echo and suffix are not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}]")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("response_format other than text is not supported")
        if self.debug_config is not None:
            self.debug_config.check_supported()

    def sampling(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            max_tokens=self.max_tokens,
            stop=stop,
            seed=self.seed,
            n=self.n,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            logit_bias=dict(self.logit_bias or {}),
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            ignore_eos=bool(self.debug_config and self.debug_config.ignore_eos),
        )


class PrepRecvRequest(CompletionRequest):
    end: int


class RemoteSendRequest(CompletionRequest):
    begin: int
    end: int
    kv_addr_info: str
    recv_rank: int


class StartGenerateRequest(CompletionRequest):
    begin: int


class ChoiceLogprobs:
    """One choice's logprobs in MLC's completion shape (`CompletionLogProbs`): parallel lists
    of tokens, their logprobs, text offsets and {alternative: logprob} maps. Tokens holding
    part of a UTF-8 character show as `bytes:\\xNN`, so alternatives never collide."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self.token_bytes = token_bytes
        self.offsets = TextOffsets()

    def _text(self, token_id: int) -> str:
        return display_token(self.token_bytes.to_bytes(token_id))

    def add(self, delta: Delta) -> dict[str, Any]:
        entries = delta.logprobs
        return {
            "text_offset": [self.offsets.add(self.token_bytes.to_bytes(lp.token_id)) for lp in entries],
            "token_logprobs": [lp.logprob for lp in entries],
            "tokens": [self._text(lp.token_id) for lp in entries],
            "top_logprobs": [{self._text(t.token_id): t.logprob for t in lp.top} for lp in entries],
        }


def choice_json(delta: Delta, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    finish = None if delta.finish_reason is None else delta.finish_reason.value
    return {"index": delta.index, "text": delta.text, "logprobs": logprobs, "finish_reason": finish}


def usage_json(usage: Usage, extra: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "extra": extra,
    }


def completion_json(
    response_id: str, model: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "id": response_id,
        "choices": choices,
        "created": int(time.time()),
        "model": model,
        "object": "text_completion",
        "usage": usage,
    }
