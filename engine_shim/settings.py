"""The shim's settings: one pydantic-settings object, read from flags and MICROSERVING_SHIM_*
environment variables at the entry point only. Unknown options are rejected."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine_shim.backends.synthetic.profile import (
    DEFAULT_PREFILL_TOK_S,
    DEFAULT_STEP_MS,
    StepProfile,
)
from engine_shim.engine.config import DEFAULT_PREFILL_CHUNK
from microserving.cpu_latency import CpuLatencySetting
from microserving.event_loop import EventLoop
from microserving.transport import DEFAULT_MAX_MESSAGE_BYTES, TransportSettings

Role = Literal["prefill", "decode", "both"]

# Prompt tokens a prefill shim's step computes (DEFAULT_PREFILL_CHUNK elsewhere). The chunk
# bounds a step's time for the decode rows that share it (their ITL); a prefill-only engine
# has none, and there a larger chunk drains a burst of prompts in fewer steps, each a pass
# over the weights (GPU run 46-47, docs/gpu.md:
# on one H100 P's chunk of 2048 against 512 cut disagg's mean first token at 64 and 128
# streams; vLLM's and SGLang's prefill instances run chunks of thousands of tokens too).
PREFILL_ROLE_CHUNK = 2048


class ShimSettings(BaseSettings):
    """Everything one engine shim process is configured with."""

    model_config = SettingsConfigDict(env_prefix="MICROSERVING_SHIM_", extra="forbid")

    backend: Literal["embedded", "mlc", "synthetic"] = Field(
        "embedded",
        description="Engine behind the shim: the in-process torch engine, MLC-LLM, or "
        "synthetic (BENCHMARK ONLY: no model, tokens on a GPU step-time schedule).",
    )
    model: str = Field("tiny", description="Model preset name or local Hugging Face directory.")
    host: str = Field("127.0.0.1", description="Interface the gRPC server binds.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535,
        description="HTTP port of Prometheus /metrics (on host); 0 picks a free one; unset: none.",
    )
    advertise_address: str | None = Field(
        None,
        description="host:port peers use to push KV to this shim (default: host and bound port).",
    )
    device: str = Field("cpu", description="Device of the embedded engine: cpu, cuda, cuda:N.")
    cpu_threads: int = Field(
        0, ge=0,
        description="Torch threads of the embedded engine on the CPU; 0: torch's default, one "
        "per core. Give each engine on a host its share of the cores: threads that outnumber "
        "the cores spin against each other (30x slower steps with 3 engines on 2 cores).",
    )
    role: Role = Field("both", description="Role advertised to the router.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weight and KV dtype of the embedded engine; auto: bfloat16 on CUDA, "
        "float32 on the CPU.",
    )
    page_size: int = Field(16, ge=1, description="Tokens per KV page (embedded).")
    num_pages: int | None = Field(
        None, ge=1, description="KV pages in the pool (embedded); default from memory budget."
    )
    kv_cache_memory_mb: int = Field(256, ge=1, description="KV pool budget when num_pages unset.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences one engine step runs at most.")
    prefill_chunk_size: int | None = Field(
        None, ge=1, description="Prompt tokens one engine step computes, over all sequences "
        f"(embedded); default {DEFAULT_PREFILL_CHUNK}, or {PREFILL_ROLE_CHUNK} on a prefill shim "
        "(role=prefill), whose steps no decode waits behind.",
    )
    enable_prefix_cache: bool = Field(True, description="Reuse KV of shared prompt prefixes.")
    cuda_graphs: bool = Field(True, description="Replay captured CUDA graphs for decode steps.")
    mixed_cuda_graphs: bool = Field(
        True, description="With cuda_graphs: steps that prefill (beside decodes or alone) "
        "replay graphs captured per token-count bucket too (false: eager, as before).",
    )
    paged_prefill: bool = Field(
        True, description="CUDA: a step's prefilling sequences in one Triton kernel launch a "
        "layer (false: one attention call per sequence, the reference).",
    )
    prefill_hold_ms: float = Field(
        0.0, ge=0.0, le=1000.0,
        description="While requests decode, a new prompt waits up to this long for others to "
        "share its prefill step (embedded; fewer steps that cannot replay a CUDA graph).",
    )
    engine_process: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Run the engine core in a process of its own (on) or a thread of the "
        "shim (off); auto: its own process on CUDA, where the engine's Python host work "
        "would otherwise share one GIL with the shim's serving; a thread on the CPU, where "
        "the engine's kernels want the cores and a pipe between the two costs CPU.",
    )
    reservation_ttl_s: float = Field(
        30.0, gt=0, description="PrepRecv reservations not followed up are reclaimed after this."
    )
    mlc_url: str | None = Field(
        None, description="Base URL of a running MLC-LLM server (mlc backend)."
    )
    mlc_model_lib: str | None = Field(
        None, description="Model lib for `mlc_llm serve` when the shim starts MLC itself."
    )
    mlc_timeout_s: float = Field(600.0, gt=0, description="Upper bound of one MLC HTTP call.")
    drain_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM/SIGINT, in-flight calls get this long to finish."
    )
    # Also the engine's export chunk, so a chunk goes out without being split and re-copied.
    # With the malloc tuning below, 16 MiB beat 8 MiB and 32 MiB side by side (docs/shim.md).
    kv_push_chunk_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest KV payload of one PushKV message."
    )
    kv_transport: Literal["auto", "nixl", "shm", "grpc"] = Field(
        "auto",
        description="How KV moves between embedded shims, chosen per peer from what the "
        "receiver offers: auto = NIXL where it loads (UCX: device to device on GPUs, host "
        "memory on the CPU, TCP or RDMA across hosts), else the same-host shared-memory "
        "stage, else the gRPC stream; nixl = NIXL or gRPC (NIXL must load); shm = shared "
        "memory or gRPC; grpc = the gRPC stream only.",
    )
    kv_nixl_local_copy: bool = Field(
        True,
        description="NIXL between two engines on one GPU: the receiver offers its pool's CUDA "
        "IPC mapping, and a sender on the same GPU writes by copying into it (one copy kernel "
        "per run of slots, beside its steps), NIXL carrying only the notification; false: "
        "every write goes through NIXL's transfer (for side-by-side measurements).",
    )
    start_after_kv_in_engine: bool = Field(
        True,
        description="A start that waits for its reservation's KV (after_kv_transfer) waits in "
        "the engine core and begins in the call that completes the KV; false: it waits in the "
        "shim and goes to the engine once the KV is there (a round trip more; for side-by-side "
        "measurements).",
    )
    kv_write_timeout_s: float = Field(
        10.0,
        gt=0,
        le=120,
        description="A NIXL write (claim, transfer, the receiver's confirmation) that takes "
        "longer fails with UNAVAILABLE and is cancelled; a receiver whose reservation ends "
        "mid-write holds its pages back this long.",
    )
    kv_shm: bool = Field(
        True,
        description="Move KV through shared memory (memfd stages) when sender and receiver "
        "run on one host; only control travels over gRPC (engine_shim/backends/embedded/kv_plane/shm.py). Off: gRPC "
        "only.",
    )
    kv_shm_max_mb: int = Field(
        1024,
        ge=1,
        description="Shared-memory stages a receiver keeps at most (one per reservation, "
        "sized for its window, reused); past it reservations are offered gRPC only.",
    )
    event_loop: EventLoop = Field(
        "auto",
        description="The serving event loop: uvloop when installed ('auto'), or force one (on the "
        "development VM a disagg shim spent 10-17% less CPU a token on uvloop; docs/throughput.md).",
    )
    cpu_latency_us: CpuLatencySetting = Field(
        None,
        description="Hold this bound (microseconds) on the host's CPU wake-up latency while the shim runs (/dev/cpu_dma_latency, needs root; 0: idle CPUs poll instead of halting). Unset or 'off': none (microserving/cpu_latency.py).",
    )
    tune_malloc: bool = Field(
        True,
        description="Raise glibc's mmap/trim thresholds so large KV buffers reuse heap pages "
        "(engine_shim/malloc_tuning.py).",
    )
    kv_peers: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="host:port addresses this shim may push KV to (comma-separated), besides "
        "the engines routers report in their status polls.",
    )
    kv_peer_ttl_s: float = Field(
        60.0, gt=0, description="How long an engine a router reported stays a KV peer unless "
        "reported again (routers poll every health interval).",
    )
    kv_push_timeout_s: float = Field(
        300.0, gt=0, description="Deadline of one KV push to a peer, queueing included."
    )
    kv_push_stall_timeout_s: float = Field(
        10.0, gt=0, le=300,
        description="A gRPC KV push whose receiver takes none of its messages (or, after the "
        "last, gives no answer) for this long, a receiver stopped or hung, fails with "
        "UNAVAILABLE naming the receiver and is cancelled (the engine's own time to compute "
        "the KV does not count); as a NIXL write's --kv-write-timeout-s.",
    )
    kv_push_stream: bool = Field(
        True,
        description="A push through the receiver's shared-memory stage (its messages carry "
        "windows, not KV) goes on one long-lived KVTransfer.PushKVStream per peer, where the "
        "receiver offers it (this setting, on the receiver), not a PushKV call of its own; "
        "false: a call per push (for side-by-side measurements).",
    )
    max_prompt_tokens: int = Field(
        1_000_000, ge=1, description="Largest prompt (token ids) one call may carry."
    )
    stream_interval_ms: float = Field(
        0.0, ge=0.0, le=1000.0,
        description="Engine.Generate: least time between two messages that carry no "
        "request's first output; several engine steps' tokens then share one message (less "
        "CPU on every hop per token, inter-token gaps up to this long). 0: one message per "
        "engine step.",
    )
    stream_updates_per_s: float = Field(
        8000.0, ge=0.0,
        description="Engine.Generate: at most this many request updates a second on one "
        "stream; with N requests running, messages are at least N / this apart (64 running: "
        "8 ms at the default), so every hop downstream pays per update, not per token, when "
        "concurrency is high. A request's first output is never held. 0: no bound.",
    )
    token: str | None = Field(None, description="Shared bearer token required on every call.")
    tls_cert: str | None = Field(None, description="PEM certificate of this shim (TLS).")
    tls_key: str | None = Field(None, description="PEM key of this shim (TLS).")
    tls_ca: str | None = Field(None, description="CA bundle: mutual TLS on the server, peer check.")
    tls_server_name: str | None = Field(None, description="Override of the peer name checked.")
    max_message_bytes: int = Field(
        DEFAULT_MAX_MESSAGE_BYTES, ge=1024, description="Largest gRPC message in either direction."
    )
    synthetic_step_ms: str = Field(
        DEFAULT_STEP_MS,
        description="Synthetic backend (benchmark only): decode step ms by batch size, "
        "BATCH:MS pairs, interpolated linearly (default: llama-1b on one H200).",
    )
    synthetic_prefill_tok_s: float = Field(
        DEFAULT_PREFILL_TOK_S, gt=0,
        description="Synthetic backend (benchmark only): prompt tokens computed per second.",
    )
    log_level: str = Field("INFO", description="Python logging level.")

    @field_validator("synthetic_step_ms")
    @classmethod
    def _step_profile_parses(cls, value: str) -> str:
        StepProfile.parse(value)  # ValueError -> a clear settings error at start-up
        return value

    @field_validator("kv_peers", mode="before")
    @classmethod
    def _split_peers(cls, value: object) -> object:
        if isinstance(value, str):
            return [peer.strip() for peer in value.split(",") if peer.strip()]
        return value

    def transport(self) -> TransportSettings:
        return TransportSettings(
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            tls_ca=self.tls_ca,
            token=self.token,
            tls_server_name=self.tls_server_name,
            max_message_bytes=self.max_message_bytes,
        )

    @property
    def engine_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    @property
    def engine_prefill_chunk(self) -> int:
        if self.prefill_chunk_size is not None:
            return self.prefill_chunk_size
        return PREFILL_ROLE_CHUNK if self.role == "prefill" else DEFAULT_PREFILL_CHUNK


def core_in_own_process(settings: ShimSettings) -> bool:
    """Whether the engine core gets a process of its own (see `engine_process`)."""
    if settings.engine_process != "auto":
        return settings.engine_process == "on"
    return settings.device.startswith("cuda")
