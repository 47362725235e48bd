"""The lenient OpenAI-shaped request model every service builds on: clients send OpenAI fields
a given API lacks, so unknown fields are accepted (as OpenAI's and MLC's servers do), never
used, and named in the log so nobody wonders why one had no effect."""

from __future__ import annotations

import logging
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

logger = logging.getLogger(__name__)


class LenientModel(BaseModel):
    """Accepts unknown fields and logs their names (at `ignored_fields_log_level`)."""

    model_config = ConfigDict(extra="allow")
    ignored_fields_log_level: ClassVar[int] = logging.INFO

    @model_validator(mode="after")
    def _log_ignored_fields(self) -> LenientModel:
        if self.model_extra and logger.isEnabledFor(self.ignored_fields_log_level):
            logger.log(self.ignored_fields_log_level, "ignored unknown fields of %s: %s",
                       type(self).__name__, ", ".join(self.ignored_fields))
        return self

    @property
    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())
