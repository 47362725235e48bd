"""Paged decode attention as one Triton kernel: each query token reads its sequence's keys and
values straight from the page pool through the block table, so no per-step gather of the whole
KV is materialised (the reference path in attention.py gathers).

Grid: (batch, kv_head). One program holds the `group` query heads that share a KV head (GQA)
and streams the context in tiles of BLOCK_N positions with an online softmax (fp32 running max,
sum and accumulator). Metadata is tensors only, so the kernel can be captured in a CUDA graph;
the loop bound is read from `context_lens` at run time.

Triton is optional: `is_available()` says whether this path can run (CUDA and Triton present,
or TRITON_INTERPRET=1 for the tests on CPU).
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None
    tl = None


def is_available(device: torch.device | str) -> bool:
    if triton is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return torch.device(device).type == "cuda"


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, context_lens_ptr,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_ob, stride_oh, stride_bt,
        scale,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        ctx_len = tl.load(context_lens_ptr + b)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        head = kv_head * GROUP + g
        g_mask = g < GROUP
        q = tl.load(
            q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :],
            mask=g_mask[:, None], other=0.0,
        )  # [GROUP_PAD, HEAD_DIM]
        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        for start in range(0, ctx_len, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            p_mask = pos < ctx_len
            page = tl.load(block_tables_ptr + b * stride_bt + pos // PAGE_SIZE, mask=p_mask, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE  # [BLOCK_N]
            kv_offset = slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            k = tl.load(k_ptr + kv_offset, mask=p_mask[:, None], other=0.0)  # [BLOCK_N, D]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            s = tl.where(p_mask[None, :], s * scale, float("-inf"))  # [GROUP_PAD, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_offset, mask=p_mask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + b * stride_ob + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None],
        )


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int, scale: float,
) -> torch.Tensor:
    """One query token per sequence.

    q: [B, Hq, D]; k_cache, v_cache: [num_slots, Hkv, D] (slot = page * page_size + offset);
    block_tables: [B, max_pages] int32; context_lens: [B] int32 (keys visible, incl. the new
    token, whose K/V must already be written). Returns [B, Hq, D] in q's dtype.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    # 64 positions a tile whatever the page size: each position finds its page through the
    # block table, so tiles may span pages (fewer loop trips than one tile per page).
    block_n = 64
    _paged_decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, context_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE_SIZE=page_size, BLOCK_N=block_n,
        # fp32 (the CPU-interpreter tests) wants exact products; 16-bit inputs ignore this.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
