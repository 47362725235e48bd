"""POST /v1/chat/completions: the request and response models."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from gateway.protocol.base import (
    INT32_MAX,
    OpenAIBaseModel,
    SamplingFields,
    StrictCount,
    StrictModel,
    Usage,
)


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessageParam(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """The message's content as one string; only text parts are supported."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content part type {part.type!r} is not supported")
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: StrictCount | None = Field(default=None, ge=1, le=INT32_MAX)
    max_completion_tokens: StrictCount | None = Field(default=None, ge=1, le=INT32_MAX)
    # Accepted only in the forms that ask for nothing this server lacks (see _unsupported).
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        unsupported = self._unsupported()
        if unsupported:
            raise ValueError(f"{unsupported}: not supported by this server")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        for index, message in enumerate(self.messages):
            if message.role == "user" and message.content is None:
                raise ValueError(f"messages.{index}.content: a user message needs content")
        for message in self.messages:
            message.text  # noqa: B018 - raises on unsupported content parts
        return self

    def _unsupported(self) -> str | None:
        """The first field asking for tool calls or structured output (refused, not ignored)."""
        if self.tools or self.functions:
            return "tools" if self.tools else "functions"
        if self.tool_choice not in (None, "none"):
            return "tool_choice"
        if self.function_call not in (None, "none"):
            return "function_call"
        if self.response_format is not None and self.response_format != {"type": "text"}:
            return "response_format"
        return None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatTopLogprob(StrictModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(StrictModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(StrictModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessage(StrictModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


ChatFinishReason = Literal["stop", "length", "abort", "error"]


class ChatChoice(StrictModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionResponse(StrictModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatDelta(StrictModel):
    """A streamed message delta. Unset fields are left out, as OpenAI streams them: the role
    only in a choice's first chunk, `{}` in a chunk that only carries the finish reason."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields: dict[str, Any] = handler(self)
        return {name: value for name, value in fields.items() if value is not None}


class ChatChunkChoice(StrictModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionChunk(StrictModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
