"""Llama-family decoder (Llama, Qwen2 with q/k/v bias, Mistral with sliding window) whose
attention reads and writes the paged KV cache.

Module names mirror Hugging Face's (`model.layers.N.self_attn.q_proj`, ...), so a checkpoint's
state dict loads by name with no mapping table.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from . import triton_fused
from .attention import AttnContext, paged_attention, write_kv
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the model dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[D/2] inverse frequencies, with Llama-3 frequency-dependent scaling when configured."""
    dim = config.head_dim
    # On the CPU even inside build_model's meta-device context (which keeps the table as it
    # is): math on meta tensors runs through torch._refs, whose first use imports
    # torch._dynamo (see Embedding).
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu")
    inv_freq = 1.0 / (config.rope_theta ** (steps.float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the
    # band in between interpolated smoothly.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, D]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, D]; rotate the two halves of D (the HF convention).
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.scale = config.head_dim**-0.5
        self.q_size, self.kv_size = q_size, kv_size
        # One [Hq*D + 2*Hkv*D, H] matrix once fuse() ran: q/k/v_proj.weight are views of it.
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    @torch.no_grad()
    def fuse(self) -> None:
        """Concatenate q/k/v into one GEMM; the three Linear weights become views of it, so
        the state dict (and its names) is unchanged and no memory is held twice."""
        self.qkv_weight = _fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        if self.q_proj.bias is not None:
            self.qkv_bias = _fuse_linears(self.q_proj, self.k_proj, self.v_proj, part="bias")

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttnContext,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.qkv_weight is not None:
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
            q_flat, k_flat, v_flat = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        else:
            q_flat, k_flat, v_flat = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q_flat.reshape(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k_flat.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v_flat.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(k_cache, v_cache, k, v, ctx.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, ctx, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))

    def forward_fused(
        self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttnContext,
    ) -> torch.Tensor:
        """The Triton path (after fuse()): one GEMM for q/k/v, one kernel for RoPE and the
        K/V writes, then the attention kernel reading q straight out of the qkv rows."""
        assert self.qkv_weight is not None
        num_tokens = x.shape[0]
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # [T, (Hq + 2 Hkv) * D]
        triton_fused.rope_and_write_kv(
            qkv, positions, inv_freq, k_cache, v_cache, ctx.slot_mapping,
            self.num_heads, self.num_kv_heads, self.head_dim,
        )
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        out = paged_attention(q, k_cache, v_cache, ctx, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # [2I, H] once fuse() ran

    @torch.no_grad()
    def fuse(self) -> None:
        self.gate_up_weight = _fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        assert self.gate_up_weight is not None
        return self.down_proj(triton_fused.silu_mul(F.linear(x, self.gate_up_weight)))


def _fuse_linears(*linears: nn.Linear, part: str = "weight") -> torch.Tensor:
    """Concatenate the linears' `part` ("weight" or "bias") along the output dim and make
    each one's parameter a view of its rows of the result."""
    fused = torch.cat([getattr(linear, part) for linear in linears], dim=0)
    start = 0
    for linear in linears:
        rows = getattr(linear, part).shape[0]
        setattr(linear, part, nn.Parameter(fused[start : start + rows], requires_grad=False))
        start += rows
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttnContext,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Embedding):
    """nn.Embedding without its random initialisation: build_model writes every weight (seeded
    or from the checkpoint), and nn.Embedding's normal_ on the meta device it is built on runs
    through torch._refs, whose first use imports torch._dynamo (1.2 s on the development VM, in
    every process that builds a model; with weights._materialize a shim starts in 2.3 s, not
    3.2)."""

    def reset_parameters(self) -> None:
        pass


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv [L, 2, slots, Hkv, D], ctx) -> hidden [T, H];
    `logits(hidden)` applies the LM head only to the rows that need sampling."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.use_fused_kernels = False

    def fuse(self, use_fused_kernels: bool) -> None:
        """Fuse the q/k/v and gate/up projections (on every device: fewer, larger GEMMs), and
        with `use_fused_kernels` run the Triton kernels of triton_fused.py (CUDA). Call it
        last: moving the module to another device or dtype afterwards would copy the fused
        weights' views apart."""
        for layer in self._decoder_layers():
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.use_fused_kernels = use_fused_kernels

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
        ctx: AttnContext,
    ) -> torch.Tensor:
        if self.use_fused_kernels:
            return self._forward_fused(input_ids, positions, kv_cache, ctx)
        x = self.model.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv_cache[i, 0], kv_cache[i, 1], ctx)
        return self.model.norm(x)

    def _forward_fused(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
        ctx: AttnContext,
    ) -> torch.Tensor:
        # The residual chain: each norm also adds the previous block's output into the
        # residual stream, so a layer is 2 norms, 4 GEMMs, RoPE+KV, attention and SiLU.
        inv_freq = self.model.rotary_emb.inv_freq
        residual = self.model.embed_tokens(input_ids)  # [T, H]
        layers = self._decoder_layers()
        h = triton_fused.add_rms_norm(
            residual, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps
        )
        for i, layer in enumerate(layers):
            attn = layer.self_attn.forward_fused(h, positions, inv_freq, kv_cache[i, 0], kv_cache[i, 1], ctx)
            norm = layer.post_attention_layernorm
            h = triton_fused.add_rms_norm(attn, norm.weight, norm.eps, residual)
            mlp = layer.mlp.forward_fused(h)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            assert isinstance(norm, RMSNorm)
            h = triton_fused.add_rms_norm(mlp, norm.weight, norm.eps, residual)
        return h

    def _decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.model.layers))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [N, H] -> [N, V] in fp32 so sampling math does not depend on the model dtype.
        return self.lm_head(hidden).float()
