"""The router's settings: one pydantic-settings object (env prefix MICROSERVING_ROUTER_),
optionally layered over a YAML/JSON config file. Precedence: CLI flags > environment >
config file > defaults.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from microserving.cpu_latency import CpuLatencySetting
from microserving.event_loop import EventLoop
from microserving.pattern_names import PatternName
from microserving.transport import TransportSettings


class RouterSettings(BaseSettings):
    """Everything the router is configured with."""

    model_config = SettingsConfigDict(env_prefix="MICROSERVING_ROUTER_", extra="forbid")

    engines: list[str] = Field(
        default_factory=list,
        description="Engine shims as HOST:PORT[=prefill|decode|both]; no role: the roles the engine reports.",
    )
    engine_dns: list[str] = Field(
        default_factory=list,
        description="DNS names NAME:PORT=ROLE re-resolved periodically (e.g. a Kubernetes headless Service).",
    )
    engine_num_gpus: list[int] = Field(
        default_factory=list,
        description="GPUs per --engine, in order (for device_id_starts / recv_rank); default 1 each.",
    )
    pattern: PatternName = Field(default="round-robin", description="Default orchestration pattern.")
    router_class: str | None = Field(
        default=None,
        description="package.module:Class of a Router subclass to run instead of Router (its "
        "translate_request replaces the built-in patterns); imported from PYTHONPATH.",
    )
    pd_balance_factor: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="Disagg: fraction of the prompt the decode engine prefills."
    )
    cache_aware: bool = Field(default=False, description="Prefer engines whose prefix cache holds the prompt.")
    model: str = Field(default="tiny", description="Model served: 'tiny' or a local Hugging Face directory.")
    model_id: str | None = Field(default=None, description="Id clients pass as `model`; default from --model.")
    host: str = Field(default="127.0.0.1", description="Address to bind.")
    port: int = Field(default=50051, ge=0, le=65535, description="Port to bind; 0 picks a free one.")
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="HTTP port of Prometheus /metrics (on host); 0 picks a free one; unset: no endpoint.",
    )

    event_loop: EventLoop = Field(
        default="auto", description="Event loop: uvloop when installed ('auto'), or force one."
    )
    cpu_latency_us: CpuLatencySetting = Field(
        default=None,
        description="Hold this bound (microseconds) on the host's CPU wake-up latency while the router runs (/dev/cpu_dma_latency, needs root; 0: idle CPUs poll instead of halting). Unset or 'off': none (microserving/cpu_latency.py).",
    )
    health_interval_s: float = Field(default=1.0, gt=0, description="Seconds between health/status polls per engine.")
    health_timeout_s: float = Field(default=2.0, gt=0, description="Deadline of one health check or GetStatus.")
    dns_interval_s: float = Field(default=5.0, gt=0, description="Seconds between DNS re-resolutions.")
    prep_recv_timeout_s: float = Field(default=10.0, gt=0, description="Deadline of a PrepRecv call.")
    remote_send_timeout_s: float = Field(default=120.0, gt=0, description="Deadline of a RemoteSend call.")
    first_token_timeout_s: float = Field(default=120.0, gt=0, description="Deadline for the first streamed message.")
    inter_token_timeout_s: float = Field(default=30.0, gt=0, description="Deadline between streamed messages.")
    abort_timeout_s: float = Field(default=2.0, gt=0, description="Deadline of an Abort call.")
    max_attempts: int = Field(default=3, ge=1, description="Engine attempts per request: retries before the first token, resumes after it.")
    max_inflight: int = Field(default=0, ge=0, description="Requests served at once; 0 = unlimited. Over it: RESOURCE_EXHAUSTED.")
    engine_stream: bool = Field(
        default=True,
        description="Built-in patterns decode over one multiplexed Engine.Generate stream per engine; "
        "false: one StartGenerate call per request.",
    )
    start_after_kv: bool = Field(
        default=True,
        description="Disaggregation: start the decode engine's request together with the prefill "
        "engine's RemoteSend, to begin as the KV lands (on the engine stream, where the decode "
        "engine serves StartGenerateRequest.after_kv_transfer); false: after RemoteSend returns.",
    )
    send_ahead: bool = Field(
        default=True,
        description="Disaggregation: make the prefill engine's RemoteSend together with the decode "
        "engine's PrepRecv, its receiver's address following on the engine stream once PrepRecv "
        "answers (where the prefill engine serves RemoteSendRequest.kv_addr_follows), so the "
        "prefill computes meanwhile; false: RemoteSend after PrepRecv returns.",
    )
    first_token_on_prefill: bool = Field(
        default=True,
        description="Disaggregation: the prefill engine samples the first token (its RemoteSend "
        "made with sample_first_token, where both engines serve it and the whole remaining prompt "
        "goes to the prefill engine), which reaches the client before the KV transfer and the "
        "decode engine's first step; the decode engine continues from it. false: MLC's protocol "
        "as it is, the decode engine samples every token.",
    )
    engine_stream_batches: bool = Field(
        default=True,
        description="On an engine's Generate stream, the actions queued behind the write in flight "
        "go out as one message (EngineGenerateRequest.batch, where the engine's status has "
        "takes_batched_actions); false: a message each (for side-by-side measurements).",
    )
    kv_full_wait_s: float = Field(
        default=5.0, ge=0,
        description="When every engine's KV cache is full, how long a new request waits for room "
        "before RESOURCE_EXHAUSTED (HTTP 429).",
    )
    max_preempt_retries: int = Field(
        default=4, ge=0,
        description="Resumes of a preempted request in a row without a new token (and for at least "
        "inter_token_timeout_s) before it fails.",
    )

    adaptive_min_remote_tokens: int = Field(default=32, ge=0, description="Adaptive: below this many uncached tokens, skip P.")
    adaptive_max_prefill_load_ratio: float = Field(default=4.0, gt=0, description="Adaptive: skip P when its load exceeds D's by this ratio.")
    adaptive_max_factor: float = Field(default=0.5, ge=0, lt=1, description="Adaptive: largest fraction D prefills.")
    cache_page_size: int = Field(default=16, gt=0, description="Cache-aware: tokens per hashed page.")
    cache_max_pages_per_engine: int = Field(default=65536, gt=0, description="Cache-aware: hashes kept per engine.")
    cache_min_match_tokens: int = Field(default=16, ge=1, description="Cache-aware: shortest match that steers placement.")
    cache_max_extra_load: float = Field(default=4.0, ge=0, description="Cache-aware: extra in-flight load accepted for a cache hit.")

    tls_cert: str | None = Field(default=None, description="PEM certificate of this router (serves TLS).")
    tls_key: str | None = Field(default=None, description="PEM key of tls_cert.")
    tls_ca: str | None = Field(default=None, description="CA bundle: verifies engines; on the server, requires client certs.")
    token: str | None = Field(default=None, description="Shared bearer token for every hop.")
    tls_server_name: str | None = Field(default=None, description="Override of the engines' certificate name (tests).")

    @property
    def transport(self) -> TransportSettings:
        return TransportSettings(
            tls_cert=self.tls_cert, tls_key=self.tls_key, tls_ca=self.tls_ca,
            token=self.token, tls_server_name=self.tls_server_name,
        )

    @property
    def served_model_id(self) -> str:
        return self.model_id or Path(self.model).name or self.model


def read_config_file(path: str) -> dict[str, Any]:
    """A YAML or JSON mapping of settings (keys as the field names, `-` or `_`)."""
    text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping")
    return {str(key).replace("-", "_"): value for key, value in data.items()}


def load_settings(config_file: str | None = None, **overrides: Any) -> RouterSettings:
    """Settings from overrides (CLI) > environment > config file > defaults."""
    file_values = read_config_file(config_file) if config_file else {}

    class _Layered(RouterSettings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, InitSettingsSource(settings_cls, init_kwargs=file_values))

    layered = _Layered(**overrides)
    return RouterSettings.model_construct(**layered.model_dump())
