"""MLC-LLM's wire types, written here from its protocol files (python/mlc_llm/protocol/
openai_api_protocol.py, microserving_protocol.py, debug_protocol.py at mlc-ai/mlc-llm HEAD):
the requests MLC's router builds (their `model_dump()` is what it POSTs) and the responses it
validates. Responses are checked strictly (extra="forbid") so a field MLC lacks shows up."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- requests (as MLC's router builds them) ----
class StreamOptions(BaseModel):
    include_usage: bool | None


class RequestResponseFormat(BaseModel):
    type: Literal["text", "json_object"] = "text"
    json_schema: str | None = Field(default=None, alias="schema")


class DisaggConfig(BaseModel):
    kind: Literal["prepare_receive", "remote_send", "start_generation"] | None = None
    kv_append_metadata: str | None = None
    kv_window_begin: int | None = None
    kv_window_end: int | None = None
    dst_group_offset: int | None = None


class DebugConfig(BaseModel):
    ignore_eos: bool = False
    pinned_system_prompt: bool = False
    special_request: Literal["query_engine_metrics"] | None = None
    grammar_execution_mode: Literal["constraint", "jump_forward"] = "jump_forward"
    disagg_config: DisaggConfig | None = None


class CompletionRequest(BaseModel):
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
    response_format: RequestResponseFormat | None = None
    debug_config: DebugConfig | None = None


class PrepRecvRequest(CompletionRequest):
    end: int


class RemoteSendRequest(CompletionRequest):
    begin: int
    end: int
    kv_addr_info: str
    recv_rank: int


class StartGenerateRequest(CompletionRequest):
    begin: int


# ---- responses (what MLC's router and clients validate) ----
class PrepRecvResponse(_Strict):
    kv_append_metadata: str
    prefix_matched_length: int


class CompletionLogProbs(_Strict):
    text_offset: list[int] | None
    token_logprobs: list[float]
    tokens: list[str]
    top_logprobs: list[dict[str, float]]


class CompletionUsage(_Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    extra: dict[str, Any] | None = None


class CompletionResponseChoice(_Strict):
    finish_reason: Literal["stop", "length", "preempt"] | None = None
    index: int = 0
    logprobs: CompletionLogProbs | None = None
    text: str


class CompletionResponse(_Strict):
    id: str
    choices: list[CompletionResponseChoice]
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str | None = None
    object: str = "text_completion"
    usage: CompletionUsage | None = None


class ModelResponse(_Strict):
    id: str
    created: int
    object: str = "model"
    owned_by: str = "MLC-LLM"


class ListResponse(_Strict):
    object: str = "list"
    data: list[ModelResponse]
