"""Fused elementwise kernels for the CUDA path of the decoder (Triton).

A decode step of a small model on a GPU is made of many tiny kernels: the reference layer
(model.py) launches about 35 per layer for RMSNorm's fp32 round trip, RoPE's halves and
concatenations, the K/V writes, SiLU and the residual adds. Inside a CUDA graph each still
costs a few microseconds of GPU time, which at batch 1 was more than half the GEMM time. These
kernels do each group in one pass over the data:

- `add_rms_norm`: residual += x, then RMSNorm of the sum (the fused residual chain: the sum
  is rounded to the model dtype first, exactly as the reference `x = x + f(x)` does);
- `rope_and_write_kv`: rotates q in place and k on the way into the paged cache, and writes
  v beside it (angles in fp32 from `inv_freq`, no cos/sin tables);
- `silu_mul`: SiLU(gate) * up from the fused gate/up projection.

Rounding follows the reference ops where it matters for equality on the CPU interpreter
(RMSNorm, SiLU); RoPE is computed in fp32 and rounded once, which is closer to fp32 than the
reference's bf16 products. Every kernel runs under TRITON_INTERPRET=1 on the CPU, where the
tests compare it with model.py's reference ops.
"""

from __future__ import annotations

import torch

from . import triton_attention
from .config import ModelConfig
from .triton_attention import tl, triton


def supports(config: ModelConfig, device: torch.device | str) -> bool:
    """Whether the fused kernels can run this model here (Triton on CUDA, or the CPU
    interpreter; tl.arange needs a power-of-two half head)."""
    half = config.head_dim // 2
    return triton_attention.is_available(device) and half > 0 and half & (half - 1) == 0

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            # The sum is rounded to the model dtype, as `x = x + f(x)` rounds in the reference.
            r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
        normed = (x32 * inv).to(x.dtype)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        y = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_write_kv_kernel(
        qkv_ptr, positions_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_t, stride_cs, stride_ch,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEADS_PAD: tl.constexpr,
    ):
        # One program per token: q heads rotated in place, k heads rotated into the cache,
        # v heads copied into the cache. Row layout of qkv: [q (Hq*D) | k (Hkv*D) | v (Hkv*D)].
        t = tl.program_id(0)
        half: tl.constexpr = HEAD_DIM // 2
        i = tl.arange(0, half)
        h = tl.arange(0, HEADS_PAD)
        pos = tl.load(positions_ptr + t).to(tl.float32)
        angle = pos * tl.load(inv_freq_ptr + i)  # [half] fp32
        cos = tl.cos(angle)[None, :]
        sin = tl.sin(angle)[None, :]
        row = qkv_ptr + t * stride_t
        # q: [HEADS_PAD, half] halves of each head
        q_mask = (h < NUM_HEADS)[:, None]
        q_lo_ptr = row + h[:, None] * HEAD_DIM + i[None, :]
        q_lo = tl.load(q_lo_ptr, mask=q_mask, other=0.0)
        q_hi = tl.load(q_lo_ptr + half, mask=q_mask, other=0.0)
        lo32, hi32 = q_lo.to(tl.float32), q_hi.to(tl.float32)
        tl.store(q_lo_ptr, (lo32 * cos - hi32 * sin).to(q_lo.dtype), mask=q_mask)
        tl.store(q_lo_ptr + half, (hi32 * cos + lo32 * sin).to(q_lo.dtype), mask=q_mask)
        # k and v
        kv_mask = (h < NUM_KV_HEADS)[:, None]
        slot = tl.load(slot_ptr + t).to(tl.int64)
        k_lo_ptr = row + NUM_HEADS * HEAD_DIM + h[:, None] * HEAD_DIM + i[None, :]
        k_lo = tl.load(k_lo_ptr, mask=kv_mask, other=0.0).to(tl.float32)
        k_hi = tl.load(k_lo_ptr + half, mask=kv_mask, other=0.0).to(tl.float32)
        cache_off = slot * stride_cs + h[:, None] * stride_ch + i[None, :]
        dst = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + cache_off, (k_lo * cos - k_hi * sin).to(dst), mask=kv_mask)
        tl.store(k_cache_ptr + cache_off + half, (k_hi * cos + k_lo * sin).to(dst), mask=kv_mask)
        v_lo_ptr = k_lo_ptr + NUM_KV_HEADS * HEAD_DIM
        v_lo = tl.load(v_lo_ptr, mask=kv_mask, other=0.0)
        v_hi = tl.load(v_lo_ptr + half, mask=kv_mask, other=0.0)
        tl.store(v_cache_ptr + cache_off, v_lo.to(dst), mask=kv_mask)
        tl.store(v_cache_ptr + cache_off + half, v_hi.to(dst), mask=kv_mask)

    @triton.jit
    def _silu_mul_kernel(
        gate_up_ptr, out_ptr, stride_g, stride_o, n_cols, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(gate_up_ptr + row * stride_g + cols, mask=mask, other=0.0)
        u = tl.load(gate_up_ptr + row * stride_g + n_cols + cols, mask=mask, other=0.0)
        g32 = g.to(tl.float32)
        act = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)  # F.silu rounds to the dtype
        y = act.to(tl.float32) * u.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm(x) over the last dim of [T, H]; with `residual`, first residual += x (in
    place) and normalise the sum. Returns the normalised [T, H] in x's dtype."""
    assert triton is not None
    num_rows, n_cols = x.shape
    out = torch.empty_like(x)
    if num_rows == 0:
        return out
    res = residual if residual is not None else x
    _rms_norm_kernel[(num_rows,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols),
    )
    return out


def rope_and_write_kv(
    qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int,
) -> None:
    """qkv: [T, (Hq + 2 Hkv) * D], contiguous rows. Rotates its q part in place and writes
    rotated k and v into the caches ([slots, Hkv, D]) at slot_mapping [T]."""
    assert triton is not None
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return
    _rope_write_kv_kernel[(num_tokens,)](
        qkv, positions, inv_freq, k_cache, v_cache, slot_mapping,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(max(num_heads, num_kv_heads)),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> SiLU(gate) * up, [T, I]."""
    assert triton is not None
    num_rows, width = gate_up.shape
    n_cols = width // 2
    out = torch.empty(num_rows, n_cols, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(n_cols))
    _silu_mul_kernel[(num_rows, triton.cdiv(n_cols, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), n_cols, BLOCK=block,
    )
    return out
