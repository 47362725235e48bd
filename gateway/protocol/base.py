"""The shared base of every OpenAI request model, and the pieces several endpoints use.

Requests accept unknown fields (OpenAI clients send new ones all the time) and log which were
ignored, so a silently dropped option is at least visible in the gateway's log.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from microserving.lenient_model import LenientModel
from microserving.pattern_names import PatternName

# The wire (proto) types behind the numbers: larger values must be a 400, not an overflow.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# Strict where OpenAI is: `true` is not 1 and `1.0` is not an int.
StrictCount = Annotated[int, Strict()]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX), Strict()]


def _as_float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


_SCALARS = {int, float}  # JSON numbers: no string inside


def _first_invalid_string(value: Any) -> str | None:
    """A string (or key) in a parsed JSON value that is not valid Unicode (a lone surrogate
    escape such as "\\ud800"), else None. Iterative: JSON may nest deeply."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            if set(map(type, item)) <= _SCALARS:  # e.g. a prompt of token ids: nothing to walk
                continue
            pending.extend(item)
    return None


class OpenAIBaseModel(LenientModel):
    """Accepts unknown fields and logs their names once per request; refuses strings that are
    not valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _reject_invalid_unicode(cls, data: Any) -> Any:
        if _first_invalid_string(data) is not None:
            raise ValueError("strings must be valid Unicode (no lone surrogate escapes)")
        return data


class StrictModel(BaseModel):
    """Response and nested models: exactly the fields declared."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class PatternHintsParam(OpenAIBaseModel):
    """Our extension `microserving: {...}`: per-request overrides of the router's pattern."""

    pattern: PatternName | None = None
    pd_balance_factor: float | None = Field(default=None, ge=0.0, lt=1.0)
    cache_aware: bool | None = None


class SamplingFields(OpenAIBaseModel):
    """Fields every generation endpoint shares, with OpenAI's ranges."""

    model: str = ""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictCount = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions (documented in docs/gateway.md).
    top_k: int = Field(default=0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    microserving: PatternHintsParam | None = None
    # Narrows the prefix-cache scope (vLLM's name); the API key always scopes it too.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _check_common(self) -> SamplingFields:
        if self.top_p is not None and _as_float32(self.top_p) <= 0.0:
            # The wire carries float32: a top_p below its range would arrive as 0.
            raise ValueError("top_p: must be > 0 as a 32-bit float (at least 1.5e-45)")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ValueError("stop: at most 16 stop strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class Usage(StrictModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ErrorInfo(StrictModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(StrictModel):
    error: ErrorInfo


def dump(model: BaseModel) -> dict[str, Any]:
    """A response model as the JSON object sent on the wire."""
    return model.model_dump(mode="json")
