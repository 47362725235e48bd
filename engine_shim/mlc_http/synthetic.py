"""BENCHMARK ONLY. The core factory that puts engine_shim/backends/synthetic's SyntheticCore behind
mlc-compat's AsyncEngine (`microserving mlc-compat --synthetic`), so `microserving bench
mlc-relay` measures the HTTP server and what fronts it rather than a CPU-bound tiny model.
Never use it to test the engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from engine_shim.backends.synthetic.core import SyntheticCore
from engine_shim.backends.synthetic.profile import StepProfile
from engine_shim.mlc_http.settings import MLCCompatSettings

if TYPE_CHECKING:
    from engine_shim.engine.config import EngineConfig
    from engine_shim.engine.llm_engine import LLMEngine


def synthetic_factory(settings: MLCCompatSettings) -> Callable[[EngineConfig], LLMEngine]:
    profile = StepProfile.parse(settings.synthetic_step_ms, settings.synthetic_prefill_tok_s)

    def build(config: EngineConfig) -> SyntheticCore:
        return SyntheticCore(config, profile)

    # SyntheticCore offers the part of LLMEngine's interface AsyncEngine calls.
    return cast("Callable[[EngineConfig], LLMEngine]", build)
