"""BENCHMARK ONLY. The `synthetic` shim backend: the embedded backend's whole serving path
(EmbeddedBackend -> AsyncEngine's engine thread and hand-offs -> KV data plane) with
SyntheticCore in place of the torch engine, so any change to that path shows up in
`microserving bench capacity` on a CPU machine. Never use it to test the engine."""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, cast

from engine_shim.backends.embedded.backend import EmbeddedBackend
from engine_shim.backends.synthetic.core import SyntheticCore
from engine_shim.backends.synthetic.profile import StepProfile
from engine_shim.settings import ShimSettings

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine_shim.engine.config import EngineConfig
    from engine_shim.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def profile_from(settings: ShimSettings) -> StepProfile:
    return StepProfile.parse(settings.synthetic_step_ms, settings.synthetic_prefill_tok_s)


class SyntheticBackend(EmbeddedBackend):
    def __init__(self, settings: ShimSettings) -> None:
        profile = profile_from(settings)
        # SyntheticCore offers the part of LLMEngine's interface AsyncEngine calls; a partial
        # of the class pickles, so it can build the core in a process of its own too.
        build = partial(SyntheticCore, profile=profile)
        super().__init__(
            settings, cast("Callable[[EngineConfig], LLMEngine]", build), name="synthetic"
        )
        self.profile = profile

    async def start(self, advertise_address: str) -> None:
        await super().start(advertise_address)
        logger.warning("synthetic backend (benchmark only): %s", self.profile.describe())
