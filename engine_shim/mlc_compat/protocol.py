"""MLC-LLM's HTTP request and response JSON (OpenAI CompletionRequest / CompletionResponse plus
the microserving window fields), as pydantic models and builders."""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from engine_shim.engine.api import Delta, SamplingParams, Usage

logger = logging.getLogger(__name__)


class _Lenient(BaseModel):
    """Accepts unknown fields, as MLC does, but logs which were ignored."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_ignored(self) -> _Lenient:
        if self.model_extra:
            logger.info("ignored fields in %s: %s", type(self).__name__, sorted(self.model_extra))
        return self


class StreamOptions(_Lenient):
    include_usage: bool = False


class DebugConfig(_Lenient):
    ignore_eos: bool = False


class CompletionRequest(_Lenient):
    model: str | None = None
    prompt: str | list[int]
    best_of: int = 1
    echo: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
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

    def sampling(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            max_tokens=self.max_tokens,
            stop=stop,
            seed=self.seed,
            n=self.n,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
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


def _logprobs_json(delta: Delta, token_bytes: Any) -> dict[str, Any]:
    def entry(token_id: int, token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token_bytes.to_bytes(token_id))}

    return {
        "content": [
            {
                **entry(lp.token_id, lp.token, lp.logprob),
                "top_logprobs": [entry(t.token_id, t.token, t.logprob) for t in lp.top],
            }
            for lp in delta.logprobs
        ]
    }


def choice_json(delta: Delta, token_bytes: Any, with_logprobs: bool) -> dict[str, Any]:
    finish = None if delta.finish_reason is None else delta.finish_reason.value
    return {
        "index": delta.index,
        "text": delta.text,
        "logprobs": _logprobs_json(delta, token_bytes) if with_logprobs else None,
        "finish_reason": finish,
    }


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "extra": None,
    }


def completion_json(
    response_id: str, model: str, choices: list[dict[str, Any]], usage: Usage | None
) -> dict[str, Any]:
    return {
        "id": response_id,
        "choices": choices,
        "created": int(time.time()),
        "model": model,
        "object": "text_completion",
        "usage": None if usage is None else usage_json(usage),
    }
