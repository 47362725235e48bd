"""POST /v1/completions: the request and response models (OpenAI's legacy completions API)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.protocol.base import (
    INT32_MAX,
    SamplingFields,
    StrictCount,
    StrictModel,
    TokenId,
    Usage,
)

# A prompt as OpenAI accepts it: text, texts, token ids, or lists of token ids.
PromptInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: StrictCount | None = Field(default=16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt: PromptInput) -> PromptInput:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        # The union's members are homogeneous lists: only a list of lists has lists in it.
        if isinstance(prompt, list) and isinstance(prompt[0], list) and not all(prompt):
            raise ValueError("prompt must not contain an empty token list")
        return prompt

    @model_validator(mode="after")
    def _no_suffix(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):  # a homogeneous list (the union's members): token ids
            return [list(prompt)]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class CompletionLogprobs(StrictModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


FinishReasonText = Literal["stop", "length", "abort", "error"]


class CompletionChoice(StrictModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonText | None = None


class CompletionResponse(StrictModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
