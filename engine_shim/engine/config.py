"""Engine configuration as data: the model's architecture (ModelConfig, with named presets or
read from a Hugging Face config.json) and the engine's knobs (EngineConfig)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from microserving.tokenizer import BYTE_SPECIAL_TOKENS

# Prompt tokens one step computes over all sequences, unless configured (a prefill shim's
# default is larger: engine_shim/settings.py, PREFILL_ROLE_CHUNK).
DEFAULT_PREFILL_CHUNK = 512

BYTE_VOCAB_SIZE = 256 + len(BYTE_SPECIAL_TOKENS)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (`rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None = None  # Mistral / Qwen2 with use_sliding_window
    init_std: float = 0.02  # only for seeded random weights (presets)

    @property
    def num_parameters(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Fast on a laptop CPU: 4 layers, GQA 4 query / 2 KV heads, byte vocabulary.
    "tiny": ModelConfig(
        architecture="llama",
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        # Larger than HF's 0.02 so the random model's logits are peaked: greedy argmax
        # then has wide margins and batched vs alone runs agree token for token.
        init_std=0.1,
    ),
    # Llama-shaped ~1.1B (Llama-3.2-1B layout with a 32000 vocab) for the GPU benchmarks. The byte
    # tokenizer covers only the first ids; generated ids past it decode to nothing.
    "llama-1b": ModelConfig(
        architecture="llama",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=16384,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        init_std=0.02,
    ),
    # ~100M parameters, for benchmarks.
    "llama-100m": ModelConfig(
        architecture="llama",
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=16,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        init_std=0.05,
    ),
}


def model_config_from_hf(path: Path) -> ModelConfig:
    """Read a Hugging Face config.json (Llama, Qwen2 or Mistral)."""
    raw: dict[str, Any] = json.loads((path / "config.json").read_text(encoding="utf-8"))
    model_type = str(raw.get("model_type", ""))
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {SUPPORTED_ARCHITECTURES}"
        )
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // num_heads
    sliding = raw.get("sliding_window")
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        sliding = None
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(_rope_theta(raw)),
        rope_scaling=_rope_scaling(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        sliding_window=int(sliding) if sliding else None,
    )


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 nests RoPE settings under `rope_parameters`; 4.x uses `rope_scaling`.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return params if isinstance(params, dict) else {}


def _rope_theta(raw: dict[str, Any]) -> float:
    return float(raw.get("rope_theta") or _rope_params(raw).get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling | None:
    params = _rope_params(raw)
    rope_type = params.get("rope_type") or params.get("type")
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling {rope_type!r} (supported: llama3)")
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"  # a preset name (MODEL_PRESETS) or a local HF directory
    device: str = "cpu"
    # Torch intra-op threads of the engine's process on the CPU; 0 keeps torch's default (one
    # per core). Engines sharing a host's cores each need a share of them: OpenMP threads of
    # one engine that outnumber its cores spin against the other engines' threads.
    cpu_threads: int = 0
    dtype: str = "float32"  # float32 | bfloat16 | float16
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # None: derive from kv_cache_memory_mb
    kv_cache_memory_mb: int = 256
    max_num_seqs: int = 64  # running sequences per step
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK  # prompt tokens computed per step, over all sequences
    # While sequences decode, a new prompt waits up to this long for others to share its
    # prefill step (scheduler.py: fewer mixed steps, which cannot replay a CUDA graph).
    prefill_hold_ms: float = 0.0
    enable_prefix_cache: bool = True
    reservation_ttl_s: float = 30.0  # prep_recv reservations not followed up are reclaimed
    seed: int = 0  # weights of presets and the default sampling generator
    kv_export_chunk_tokens: int = 256  # remote_send hands KV over in chunks of this many tokens
    # When set, chunks of as many whole tokens as fit these bytes instead (at least one):
    # the shim matches its message size so chunks go out without being split and re-copied.
    kv_export_chunk_bytes: int | None = None
    max_context_length: int | None = None  # None: the model's max_position_embeddings
    cuda_graphs: bool = True  # on CUDA, replay captured graphs for decode steps
    # With cuda_graphs and paged_prefill: steps that prefill (beside decodes or alone) replay
    # graphs captured per token-count bucket too (mixed_graphs.py); False runs them eagerly.
    mixed_cuda_graphs: bool = True
    # On CUDA, a step's prefilling sequences go through one Triton kernel launch a layer
    # (triton_prefill.py); False: one SDPA per sequence, the reference (for comparisons).
    paged_prefill: bool = True
    # Launch step N+1 before detokenizing step N's tokens (requests without stop strings),
    # so the host's text and delta work runs while the device computes. None: on CUDA only
    # (on the CPU the forward itself is the host's work, so there is nothing to overlap).
    overlap_steps: bool | None = None
    # With overlap_steps: when the running batch is all plain-greedy decode (no stop
    # strings, n = 1) and nothing waits, launch step N+1 before step N's tokens reach the
    # host, its input ids taken on the device from step N's argmax, so the device never
    # waits for the host between decode steps. None: the value of overlap_steps.
    chain_decode: bool | None = None
    extra: dict[str, str] = field(default_factory=dict)  # reserved; must stay empty

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.cpu_threads < 0:
            raise ValueError("cpu_threads must be >= 0")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if self.max_num_seqs < 1 or self.prefill_chunk_size < 1:
            raise ValueError("max_num_seqs and prefill_chunk_size must be >= 1")
        if not 0.0 <= self.prefill_hold_ms <= 1000.0:
            raise ValueError("prefill_hold_ms must be within [0, 1000]")
        if self.kv_export_chunk_tokens < 1:
            raise ValueError("kv_export_chunk_tokens must be >= 1")
        if self.kv_export_chunk_bytes is not None and self.kv_export_chunk_bytes < 1:
            raise ValueError("kv_export_chunk_bytes must be >= 1")
        if self.extra:
            raise ValueError(f"unknown engine options: {sorted(self.extra)}")

    def with_overrides(self, **changes: Any) -> EngineConfig:
        return replace(self, **changes)


def resolve_model_config(name_or_dir: str) -> ModelConfig:
    if name_or_dir in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_dir]
    path = Path(name_or_dir)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"unknown model {name_or_dir!r}: not a preset {tuple(MODEL_PRESETS)} "
            "and not a directory holding config.json"
        )
    return model_config_from_hf(path)
