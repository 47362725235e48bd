"""Paged decode attention as one Triton kernel: each query token reads its sequence's keys and
values straight from the page pool through the block table, so no per-step gather of the whole
KV is materialised (the reference path in attention.py gathers).

Grid: (batch, kv_head, split). One program holds the `group` query heads that share a KV head
(GQA) and streams its part of the context in tiles of BLOCK_N positions with an online softmax
(fp32 running max, sum and accumulator). When batch x KV heads is too few programs to fill the
GPU (batch 1: 8 programs for 132 multiprocessors), each context is cut into NUM_SPLITS parts
and a second kernel merges the partial results (split-context, "flash-decoding"). Metadata is
tensors only, so both kernels can be captured in a CUDA graph; the loop bounds are read from
`context_lens` at run time.

Triton is optional: `is_available()` says whether this path can run (CUDA and Triton present,
or TRITON_INTERPRET=1 for the tests on CPU).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

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
        q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr, block_tables_ptr, context_lens_ptr,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_ob, stride_oh, stride_os,
        stride_mb, stride_mh, stride_bt,
        scale,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # Program (b, kv_head, split) covers one NUM_SPLITS-th of the context, in whole tiles.
        # With one split it writes the final output; with several it writes its normalised
        # partial output and its softmax max and sum, which _combine_splits_kernel merges.
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        ctx_len = tl.load(context_lens_ptr + b)
        split_len = tl.cdiv(tl.cdiv(ctx_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, ctx_len)
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
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            p_mask = pos < hi
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
        out = acc / tl.maximum(l_i, 1e-30)[:, None]  # an empty split (l = 0) writes zeros
        tl.store(
            out_ptr + b * stride_ob + head[:, None] * stride_oh + split * stride_os + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None],
        )
        if NUM_SPLITS > 1:
            ml_offset = b * stride_mb + head * stride_mh + split
            tl.store(m_ptr + ml_offset, m_i, mask=g_mask)
            tl.store(l_ptr + ml_offset, l_i, mask=g_mask)

    @triton.jit
    def _combine_splits_kernel(
        partial_ptr, m_ptr, l_ptr, out_ptr,
        stride_pb, stride_ph, stride_ps, stride_mb, stride_mh, stride_ob, stride_oh,
        NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        # Program (b, head): weight each split's partial output by its share of the softmax
        # mass, exp(m_s - max m) * l_s (empty splits have m = -inf and weigh nothing).
        b = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, HEAD_DIM)
        m = tl.load(m_ptr + b * stride_mb + head * stride_mh + s)
        l_s = tl.load(l_ptr + b * stride_mb + head * stride_mh + s)
        weight = tl.exp(m - tl.max(m, 0)) * l_s  # [NUM_SPLITS]
        partial = tl.load(
            partial_ptr + b * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :]
        )  # [NUM_SPLITS, HEAD_DIM] fp32
        out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)
        tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True)
class LaunchConfig:
    num_splits: int  # parts each context is cut into (a power of two)
    block_n: int  # positions a tile
    num_warps: int


def launch_config(batch: int, num_kv_heads: int, device: torch.device | str) -> LaunchConfig:
    """The decode kernel's launch for a batch, from `gpu_bench --sweep-attention` on an H200
    (132 multiprocessors; 1B Llama, 8 KV heads, 576-key contexts, each kernel replayed from a
    CUDA graph):
    - fewer programs (batch x KV heads) than multiprocessors: split each context for about
      four programs a multiprocessor (a power of two, at most 16); batch 1 ran 5.9 us this
      way, against 20+ us unsplit;
    - up to four programs a multiprocessor: one split, 128-position tiles (batch 32: 13.1 us,
      2.9 TB/s, against 15.2 us with four splits of 64-position tiles plus the merge);
    - more: one split, 64-position tiles, two warps (batch 128: 41.8 us, 3.6 TB/s, against
      50.6 us with four warps)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return LaunchConfig(1, 64, 4)
    sms = _multiprocessors(dev.index if dev.index is not None else torch.cuda.current_device())
    programs = batch * num_kv_heads
    if programs < sms:
        return LaunchConfig(min(16, triton.next_power_of_2(triton.cdiv(4 * sms, programs))), 64, 4)
    if programs <= 4 * sms:
        return LaunchConfig(1, 128, 4)
    return LaunchConfig(1, 64, 2)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int, scale: float,
    num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
) -> torch.Tensor:
    """One query token per sequence.

    q: [B, Hq, D] (rows may be strided, e.g. the q part of fused qkv rows); k_cache, v_cache:
    [num_slots, Hkv, D] (slot = page * page_size + offset); block_tables: [B, max_pages]
    int32; context_lens: [B] int32 (keys visible, incl. the new token, whose K/V must already
    be written). `num_splits` (a power of two) cuts each context into parts run by separate
    programs and merged by a second kernel; `block_n` is the positions a tile, `num_warps`
    the warps a program. Each left out comes from `launch_config` for this batch (the
    others are there for tests and gpu_bench --sweep-attention). Returns [B, Hq, D] in q's
    dtype.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    tuned = launch_config(batch, num_kv_heads, q.device)
    splits = tuned.num_splits if num_splits is None else num_splits
    block_n = tuned.block_n if block_n is None else block_n
    num_warps = tuned.num_warps if num_warps is None else num_warps
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if splits == 1:
        partial, m, l_sum = out.unsqueeze(2), out, out  # m, l unused with one split
    else:
        partial = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        m = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
        l_sum = torch.empty_like(m)
    # Tiles are whole positions, whatever the page size: each position finds its page
    # through the block table, so tiles may span pages (fewer loop trips than one tile per
    # page).
    _paged_decode_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, partial, m, l_sum, block_tables, context_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2),
        m.stride(0), m.stride(1), block_tables.stride(0),
        scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE_SIZE=page_size, BLOCK_N=block_n, NUM_SPLITS=splits,
        # fp32 (the CPU-interpreter tests) wants exact products; 16-bit inputs ignore this.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
    if splits > 1:
        _combine_splits_kernel[(batch, num_heads)](
            partial, m, l_sum, out,
            partial.stride(0), partial.stride(1), partial.stride(2), m.stride(0), m.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=splits, HEAD_DIM=head_dim,
        )
    return out
