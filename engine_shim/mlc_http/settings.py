"""Settings of `microserving mlc-compat` (env prefix MICROSERVING_MLC_COMPAT_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine_shim.backends.synthetic.profile import (
    DEFAULT_PREFILL_TOK_S,
    DEFAULT_STEP_MS,
    StepProfile,
)
from microserving.event_loop import EventLoop


class MLCCompatSettings(BaseSettings):
    """The embedded engine served over MLC-LLM's HTTP microserving wire format."""

    model_config = SettingsConfigDict(env_prefix="MICROSERVING_MLC_COMPAT_", extra="forbid")

    model: str = Field("tiny", description="Model preset name or local Hugging Face directory.")
    host: str = Field("127.0.0.1", description="Interface the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port; 0 picks a free one.")
    device: str = Field("cpu", description="cpu, cuda or cuda:N.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="KV dtype.")
    page_size: int = Field(16, ge=1, description="Tokens per KV page.")
    num_pages: int | None = Field(None, ge=1, description="KV pages in the pool.")
    kv_cache_memory_mb: int = Field(256, ge=1, description="KV pool budget without num_pages.")
    enable_prefix_cache: bool = Field(
        True,
        description="Match prompts against cached KV (MLC's prefix_cache_mode radix, the "
        "default of `mlc_llm serve`); false is MLC's prefix_cache_mode disable, the MicroServing "
        "tutorial's setting, under which prep_recv always reports prefix_matched_length 0.",
    )
    reservation_ttl_s: float = Field(30.0, gt=0, description="TTL of a prep_recv reservation.")
    peers: dict[int, str] = Field(
        default_factory=dict,
        description="recv_rank -> base URL of the compat server holding that rank (the KV "
        "destination of remote_send, standing in for MLC's NVSHMEM world).",
    )
    kv_chunk_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest KV POST body.")
    max_num_seqs: int = Field(64, ge=1, description="Running sequences per engine step.")
    synthetic: bool = Field(
        False,
        description="BENCHMARK ONLY: the synthetic engine core (no model; tokens on a GPU "
        "step-time schedule) behind the same server, to measure what relays it. Never for tests "
        "that claim to test the engine.",
    )
    synthetic_step_ms: str = Field(
        DEFAULT_STEP_MS, description="Synthetic core: decode step ms by batch size (BATCH:MS,...)."
    )
    synthetic_prefill_tok_s: float = Field(
        DEFAULT_PREFILL_TOK_S, gt=0, description="Synthetic core: prompt tokens per second."
    )
    log_level: str = Field("INFO", description="Python logging level.")
    event_loop: EventLoop = Field(
        "auto",
        description="The server's event loop: uvloop when installed ('auto'), or force one. Its "
        "socket writes, one per running request per engine step, were a quarter of a synthetic "
        "engine's process on asyncio's own loop (bench mlc-relay's profile).",
    )

    @field_validator("synthetic_step_ms")
    @classmethod
    def _step_profile_parses(cls, value: str) -> str:
        StepProfile.parse(value)  # ValueError -> a clear settings error at start-up
        return value
