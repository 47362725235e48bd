"""Model weights: seeded random initialisation for presets (identical in every process) and
memory-mapped loading of Hugging Face safetensors shards; plus the model fingerprint."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from . import triton_fused
from .config import ModelConfig
from .model import CausalLM

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Checkpoint tensors we do not need (RoPE tables are recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_model(
    config: ModelConfig, model_dir: Path | None, seed: int, device: str, dtype: str
) -> CausalLM:
    # Build on the meta device so no memory is spent on weights that are replaced at once.
    with torch.device("meta"):
        model = CausalLM(config)
    _materialize(model, "cpu")  # the RoPE table, computed on the CPU, is kept as it is
    if model_dir is None:
        init_random_weights(model, config, seed)
    else:
        load_hf_weights(model, model_dir)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device=device, dtype=DTYPES[dtype])
    # inv_freq stays fp32: RoPE angles in low precision drift at long positions.
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.float()
    model = model.eval().requires_grad_(False)
    model.fuse(use_fused_kernels=triton_fused.supports(config, device))
    return model


def _materialize(model: nn.Module, device: str) -> None:
    """Module.to_empty(device) for the tensors still on the meta device, without
    torch.empty_like on them, which runs through torch._refs and imports sympy on first use
    (0.35 s of every shim's start on the development VM). As with to_empty, a tensor two
    modules share (tied weights) becomes two: build_model ties them again, and the seeded
    initialisation draws for each as it always has."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                fresh = torch.empty(param.shape, dtype=param.dtype, device=device)
                setattr(module, name, nn.Parameter(fresh, param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))


def init_random_weights(model: CausalLM, config: ModelConfig, seed: int) -> None:
    """Normal(0, init_std) matrices, unit norms, zero biases, in sorted-name order from one
    seeded CPU generator, so every process builds the same weights."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, config.init_std, generator=generator)


def load_hf_weights(model: CausalLM, model_dir: Path) -> None:
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for shard in shards:
        # safe_open memory-maps the file; each tensor is copied once into its parameter.
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} in {shard.name}")
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(
                        f"weight {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(params[name].shape)}"
                    )
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(name)
    missing = set(params) - loaded
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")


def model_fingerprint(config: ModelConfig, model_dir: Path | None, seed: int, dtype: str) -> str:
    """Same fingerprint <=> same architecture, same weights, same KV dtype, so KV computed by
    one engine is valid in the other. Weights are identified by the preset seed or by the
    shards' names, sizes and safetensors headers (cheap, and changes when the weights do)."""
    digest = hashlib.sha256(config.to_json().encode())
    digest.update(dtype.encode())
    if model_dir is None:
        digest.update(f"seed={seed}".encode())
    else:
        for shard in sorted(model_dir.glob("*.safetensors")):
            digest.update(shard.name.encode())
            digest.update(str(shard.stat().st_size).encode())
            with shard.open("rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                digest.update(f.read(min(header_len, 1 << 20)))
    return digest.hexdigest()[:16]
