"""GET /v1/models: the model list."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.protocol.base import StrictModel


class ModelCard(StrictModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(StrictModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
