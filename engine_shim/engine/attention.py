"""Attention over the paged KV cache.

A step's tokens are flattened into one batch of T tokens from B sequences. Each sequence
contributes `q_len` query tokens at positions [ctx_len - q_len, ctx_len) and reads keys/values
of positions [0, ctx_len) from the cache through its slot list (absolute slot indices derived
from its block table). This is the gather-based reference path: correct on any device, one
sequence at a time so a sequence's numbers do not depend on what else is in the batch. On CUDA
a decode step instead carries tensor metadata (`PagedDecode`) and runs the Triton kernel of
triton_attention.py, which reads K/V through the block table without gathering them; the
prefilling sequences of a step go through one kernel of triton_prefill.py together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .triton_attention import paged_decode_attention
from .triton_prefill import PagedPrefill, paged_prefill_attention


@dataclass
class SeqAttnInfo:
    q_start: int  # offset of the sequence's first query token in the flat batch
    q_len: int
    ctx_len: int  # keys/values visible to the last query token (incl. the new ones)
    kv_slots: torch.Tensor  # [ctx_len] int64 absolute slots of positions 0..ctx_len-1


@dataclass
class DecodeBatch:
    """All sequences decode one token: K/V gathered in one padded batch instead of a loop."""

    kv_slots: torch.Tensor  # [B, max_ctx] int64, padded with slot 0
    key_mask: torch.Tensor  # [B, 1, 1, max_ctx] bool: key position < ctx_len (and in window)


@dataclass
class PagedDecode:
    """Decode metadata as tensors only (CUDA graphs capture it): one query per sequence."""

    block_tables: torch.Tensor  # [B, max_pages] int32 page ids
    context_lens: torch.Tensor  # [B] int32 keys visible, including the new token
    page_size: int


@dataclass
class MixedDecode:
    """The decode rows of a step that also prefills (CUDA): one query each, through the Triton
    kernel in one launch, while only the prefilling sequences take the per-sequence path."""

    rows: torch.Tensor  # [B_decode] int64: the rows of the flat batch that decode
    paged: PagedDecode


@dataclass
class StaticMixed:
    """A step that prefills, in the static shapes of a captured graph (mixed_graphs.py): the
    decode kernel runs over every row (rows that do not decode have no keys and come out
    zero), then the prefill kernel overwrites the prefill rows; both read one block table."""

    decode: PagedDecode  # context_lens: [T], 0 for rows that do not decode
    prefill: PagedPrefill  # tiles past the step's own hold no queries


@dataclass
class AttnContext:
    """Everything attention needs for one forward pass, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    seqs: list[SeqAttnInfo]
    sliding_window: int | None = None
    decode: DecodeBatch | None = None  # set when every q_len == 1
    paged_decode: PagedDecode | None = None  # CUDA decode through the Triton kernel
    mixed_decode: MixedDecode | None = None  # CUDA: the decode rows of a mixed step
    paged_prefill: PagedPrefill | None = None  # CUDA: every prefilling sequence, one kernel
    static_mixed: StaticMixed | None = None  # CUDA: a mixed step in a graph's static shapes


def build_decode_batch(seqs: list[SeqAttnInfo], sliding_window: int | None) -> DecodeBatch:
    max_ctx = max(s.ctx_len for s in seqs)
    device = seqs[0].kv_slots.device
    slots = torch.zeros(len(seqs), max_ctx, dtype=torch.int64, device=device)
    ctx_lens = torch.tensor([s.ctx_len for s in seqs], device=device)
    for i, seq in enumerate(seqs):
        slots[i, : seq.ctx_len] = seq.kv_slots
    k_pos = torch.arange(max_ctx, device=device)[None, :]
    mask = k_pos < ctx_lens[:, None]  # [B, max_ctx]
    if sliding_window is not None:
        mask &= k_pos >= ctx_lens[:, None] - sliding_window
    return DecodeBatch(kv_slots=slots, key_mask=mask[:, None, None, :])


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # k_cache, v_cache: [num_slots, Hkv, D]; k, v: [T, Hkv, D]
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttnContext,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D] -> out: [T, Hq, D]; K/V of the new tokens are already in the cache."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if ctx.static_mixed is not None:
        decode = ctx.static_mixed.decode
        out = paged_decode_attention(
            q, k_cache, v_cache, decode.block_tables, decode.context_lens, decode.page_size, scale,
            num_splits=1,  # a split of an empty context would merge to 0/0
        )
        paged_prefill_attention(q, k_cache, v_cache, out, ctx.static_mixed.prefill, scale)
        return out
    if ctx.paged_decode is not None:
        meta = ctx.paged_decode
        return paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.page_size, scale
        )
    if ctx.decode is not None:
        return _decode_attention(q, k_cache, v_cache, ctx.decode, group, scale)
    out = torch.empty_like(q)
    if ctx.mixed_decode is not None:  # ctx.seqs then holds only the prefilling sequences
        mixed = ctx.mixed_decode
        meta = mixed.paged
        out[mixed.rows] = paged_decode_attention(
            q.index_select(0, mixed.rows), k_cache, v_cache, meta.block_tables,
            meta.context_lens, meta.page_size, scale,
        )
    if ctx.paged_prefill is not None:  # ctx.seqs is then empty
        paged_prefill_attention(q, k_cache, v_cache, out, ctx.paged_prefill, scale)
    for seq in ctx.seqs:
        # 4-D [1, H, len, D] inputs: SDPA's fused (flash / memory-efficient) kernels need a
        # batch dimension; 3-D inputs fall back to the math kernel, quadratic in memory.
        q_seq = q[seq.q_start : seq.q_start + seq.q_len].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        k = k_cache.index_select(0, seq.kv_slots).transpose(0, 1)[None]  # [1, Hkv, ctx, D]
        v = v_cache.index_select(0, seq.kv_slots).transpose(0, 1)[None]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)  # [1, Hq, ctx, D]
            v = v.repeat_interleave(group, dim=1)
        # A whole prompt at once (queries cover every key) is plain causal attention, which
        # SDPA's fused kernels run without materialising a [q_len, ctx] mask.
        is_causal = seq.q_len == seq.ctx_len > 1 and ctx.sliding_window is None
        mask = None if is_causal else _causal_mask(seq, ctx.sliding_window, q.device)
        o = F.scaled_dot_product_attention(
            q_seq, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=is_causal, scale=scale
        )
        out[seq.q_start : seq.q_start + seq.q_len] = o[0].transpose(0, 1)
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
    group: int, scale: float,
) -> torch.Tensor:
    # q: [B, Hq, D] -> [B, Hq, 1, D]; k, v: [B, max_ctx, Hkv, D] -> [B, Hq, max_ctx, D]
    k = k_cache[batch.kv_slots].transpose(1, 2).to(q.dtype)
    v = v_cache[batch.kv_slots].transpose(1, 2).to(q.dtype)
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=batch.key_mask, scale=scale)
    return out[:, :, 0, :]


def _causal_mask(
    seq: SeqAttnInfo, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    if seq.q_len == 1 and (sliding_window is None or seq.ctx_len <= sliding_window):
        return None  # one query sees every cached key: no mask needed
    q_pos = torch.arange(seq.ctx_len - seq.q_len, seq.ctx_len, device=device)[:, None]
    k_pos = torch.arange(seq.ctx_len, device=device)[None, :]
    mask = k_pos <= q_pos  # [q_len, ctx]
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask
