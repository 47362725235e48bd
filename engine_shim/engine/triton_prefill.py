"""Paged prefill attention as one Triton kernel for every prefilling sequence of a step.

The reference path (attention.py) runs one SDPA per prefilling sequence per layer, after
gathering its keys and values and repeating them for GQA: about ten launches per sequence per
layer, all Python. A step that prefills eight prompts beside a decode batch spent most of its
host time there (the engine core was CPU-bound on such mixed steps on an H200). Here one launch
per layer covers them all: each program takes BLOCK_M query tokens of one sequence and one
query head, and streams that sequence's keys and values straight from the page pool through
its block table, causal, with an online softmax (fp32 running max, sum and accumulator), as
the decode kernel in triton_attention.py does for one query.

A sequence's queries sit at positions [ctx_len - q_len, ctx_len): chunked prefill and prefix
cache hits (keys already in the pool) are the general case, a whole prompt the special one.
Full attention only (the runner keeps the reference path for sliding windows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_attention import tl, triton


@dataclass
class PagedPrefill:
    """Prefill metadata as device tensors (see `build_paged_prefill`)."""

    block_tables: torch.Tensor  # [S, max_pages] int32 page ids
    # [tiles, 5] int32: sequence, first query of the tile, and the sequence's first row in
    # the flat batch, q_len and ctx_len (repeated per tile: a program reads only its row)
    tile_meta: torch.Tensor
    block_m: int  # queries a tile
    page_size: int


@dataclass(frozen=True)
class PrefillRows:
    """One prefilling sequence of a step, as the runner lays it out on the host."""

    q_start: int  # row of its first query in the flat batch
    q_len: int
    ctx_len: int
    block_table: list[int]


def build_paged_prefill(seqs: list[PrefillRows], page_size: int, device: torch.device) -> PagedPrefill:
    """One host-to-device copy for all of it: both tables are views of one tensor."""
    block_m = 16 if max(s.q_len for s in seqs) <= 16 else 64
    width = max(len(s.block_table) for s in seqs)
    flat: list[int] = []
    for s in seqs:
        flat += s.block_table
        flat += [0] * (width - len(s.block_table))
    num_tiles = 0
    for i, s in enumerate(seqs):
        for m0 in range(0, s.q_len, block_m):
            flat += (i, m0, s.q_start, s.q_len, s.ctx_len)
            num_tiles += 1
    packed = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
    table_end = len(seqs) * width
    return PagedPrefill(
        packed[:table_end].view(len(seqs), width),
        packed[table_end:].view(num_tiles, 5),
        block_m,
        page_size,
    )


if triton is not None:

    @triton.jit
    def _paged_prefill_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, tile_meta_ptr,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
        scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        tile = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        seq = tl.load(tile_meta_ptr + 5 * tile)
        m0 = tl.load(tile_meta_ptr + 5 * tile + 1)
        q_start = tl.load(tile_meta_ptr + 5 * tile + 2)
        q_len = tl.load(tile_meta_ptr + 5 * tile + 3)
        ctx_len = tl.load(tile_meta_ptr + 5 * tile + 4)
        m = m0 + tl.arange(0, BLOCK_M)
        m_mask = m < q_len
        q_pos = ctx_len - q_len + m  # each query's position; it sees keys 0..q_pos
        d = tl.arange(0, HEAD_DIM)
        rows = (q_start + m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
            mask=m_mask[:, None], other=0.0,
        )  # [BLOCK_M, HEAD_DIM]
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # Keys up to the tile's last query (the first tile holds position 0 for every row,
        # so no row's running max stays -inf past it).
        hi = tl.minimum(ctx_len, ctx_len - q_len + m0 + BLOCK_M)
        for start in range(0, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            p_mask = pos < hi
            page = tl.load(block_tables_ptr + seq * stride_bt + pos // PAGE_SIZE, mask=p_mask, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE  # [BLOCK_N]
            kv_offset = slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            k = tl.load(k_ptr + kv_offset, mask=p_mask[:, None], other=0.0)  # [BLOCK_N, D]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            visible = p_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            s = tl.where(visible, s * scale, float("-inf"))  # [BLOCK_M, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_offset, mask=p_mask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None],
        )


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    meta: PagedPrefill, scale: float, block_n: int = 64, num_warps: int = 4,
) -> None:
    """Writes the attention of every prefilling sequence's queries into their rows of `out`.

    q, out: [T, Hq, D] (rows may be strided, e.g. the q part of fused qkv rows); k_cache,
    v_cache: [num_slots, Hkv, D], the new tokens' K/V already written. Rows of `out` that
    belong to no prefilling sequence are left as they are."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[1]
    grid = (meta.tile_meta.shape[0], num_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.tile_meta,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        scale,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=meta.page_size,
        BLOCK_M=meta.block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
