"""OpenAI completion request / response models with MLC-LLM's field names, so a custom router
written against `mlc_llm.protocol.openai_api_protocol` ports with an import change.

Extensions over MLC (all optional): `top_k` and `stop_token_ids` on the request, `token_ids`
on a response choice (the router relays token ids, not only text).
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from microserving.lenient_model import LenientModel


class _LenientModel(LenientModel):
    # DEBUG: the router's models are built per request on a custom router's path.
    ignored_fields_log_level: ClassVar[int] = logging.DEBUG


class StreamOptions(_LenientModel):
    include_usage: bool | None = None


class ResponseFormat(_LenientModel):
    type: Literal["text", "json_object"] = "text"
    json_schema: str | None = Field(default=None, alias="schema")


class DisaggConfig(_LenientModel):
    kind: str | None = None
    kv_append_metadata: list[int] = Field(default_factory=list)
    kv_window_begin: int | None = None
    kv_window_end: int | None = None
    dst_group_offset: int | None = None


class DebugConfig(_LenientModel):
    ignore_eos: bool = False
    pinned_system_prompt: bool = False
    special_request: str | None = None
    grammar_execution_mode: str = "jump_forward"
    disagg_config: DisaggConfig | None = None


class CompletionRequest(_LenientModel):
    """OpenAI /v1/completions request as MLC's router receives it. `prompt` is text until the
    router tokenizes it; translate_request always sees a list of token ids."""

    model: str | None = None
    prompt: str | list[int]
    best_of: int = 1
    echo: bool = False
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
    response_format: ResponseFormat | None = None
    debug_config: DebugConfig | None = None
    # Extensions (not in MLC): sampling knobs our contract carries.
    top_k: int = 0
    stop_token_ids: list[int] | None = None
    # The prefix-cache scope (vLLM's name; SamplingParams.cache_salt): the gateway's tenant
    # scope of this request. The router's helpers apply the request's scope to every engine
    # call whatever a custom translate_request sets here.
    cache_salt: str | None = None


class TopLogProbs(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class LogProbsContent(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogProbs] = Field(default_factory=list)
    token_id: int | None = None  # extension


class LogProbs(BaseModel):
    content: list[LogProbsContent] = Field(default_factory=list)


FinishReasonText = Literal["stop", "length", "preempt", "abort", "error"]


class CompletionResponseChoice(BaseModel):
    index: int = 0
    text: str = ""
    logprobs: LogProbs | None = None
    finish_reason: FinishReasonText | None = None
    token_ids: list[int] | None = None  # extension: the tokens behind `text`


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    extra: dict[str, Any] | None = None


class CompletionResponse(BaseModel):
    """One /v1/completions response (or one stream chunk of it)."""

    id: str
    choices: list[CompletionResponseChoice]
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str | None = None
    object: str = "text_completion"
    usage: UsageInfo | None = None
