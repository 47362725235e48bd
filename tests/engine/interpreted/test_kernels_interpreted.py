"""The Triton kernels of the CUDA path, run by Triton's CPU interpreter against the reference
torch ops they replace. Collected only with TRITON_INTERPRET=1 (the kernels are built as
interpreted functions at import); tests/engine/test_triton_interpreted.py runs this folder in
a subprocess with it set."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_triton_interpreted.py"
)

triton = pytest.importorskip("triton")

from engine_shim.engine import triton_fused  # noqa: E402
from engine_shim.engine.config import resolve_model_config  # noqa: E402
from engine_shim.engine.model import RMSNorm, RotaryEmbedding, apply_rope  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    # fp32 is the tight check. bf16 allows a few units in the last place (2^-8 relative):
    # the interpreter emulates bf16 through numpy and does not round each step as CUDA does
    # (the GPU tests check bf16 on the device).
    if dtype == torch.float16:
        return {"atol": 2e-3, "rtol": 2**-8}
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2**-5}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_equals_the_reference(dtype: torch.dtype, with_residual: bool) -> None:
    torch.manual_seed(0)
    hidden = 96  # not a power of two: the kernel masks the padded columns
    x = torch.randn(5, hidden).to(dtype)
    residual = torch.randn(5, hidden).to(dtype)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden) + 0.5)
        expected_sum = residual + x if with_residual else x
        expected = norm(expected_sum)
    res = residual.clone() if with_residual else None
    out = triton_fused.add_rms_norm(x, norm.weight, norm.eps, res)
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    if res is not None:
        torch.testing.assert_close(res, expected_sum, **tolerance(dtype))  # summed in place


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_the_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    gate_up = (torch.randn(3, 2 * 1500) * 3).to(dtype)  # 1500 columns: two tiles, one partial
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(triton_fused.silu_mul(gate_up), expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_write_kv_equals_the_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    hq, hkv, d = 6, 2, 16
    config = dataclasses.replace(resolve_model_config("tiny"), num_heads=hq, num_kv_heads=hkv, head_dim=d)
    rotary = RotaryEmbedding(config)
    positions = torch.tensor([0, 3, 17, 250])
    qkv = torch.randn(4, (hq + 2 * hkv) * d).to(dtype)
    q, k, v = qkv.float().split((hq * d, hkv * d, hkv * d), dim=-1)
    cos, sin = rotary(positions, torch.float32)
    q_ref = apply_rope(q.reshape(4, hq, d), cos, sin)
    k_ref = apply_rope(k.reshape(4, hkv, d), cos, sin)
    k_cache = torch.zeros(40, hkv, d, dtype=dtype)
    v_cache = torch.zeros(40, hkv, d, dtype=dtype)
    slots = torch.tensor([5, 6, 33, 0])
    triton_fused.rope_and_write_kv(qkv, positions, rotary.inv_freq, k_cache, v_cache, slots, hq, hkv, d)
    tol = tolerance(dtype)
    torch.testing.assert_close(qkv[:, : hq * d].float().reshape(4, hq, d), q_ref, **tol)
    torch.testing.assert_close(k_cache[slots].float(), k_ref, **tol)
    torch.testing.assert_close(v_cache[slots].float(), v.reshape(4, hkv, d).to(dtype).float(), atol=0, rtol=0)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_engine_on_the_fused_kernels_gives_the_reference_tokens() -> None:
    """A whole tiny engine (fp32) on the fused kernels, prefill and batched decode, against
    the same engine on the reference ops: token-exact at temperature 0."""
    from engine_shim.engine.api import SamplingParams
    from engine_shim.engine.config import EngineConfig
    from engine_shim.engine.llm_engine import LLMEngine

    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(5 + 9 * i)] for i in range(3)]
    results = []
    for fused in (True, False):
        engine = LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32", num_pages=64, page_size=16))
        assert engine.model.use_fused_kernels  # supports() is true under the interpreter
        engine.model.use_fused_kernels = fused
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, sampling)
        outputs = engine.run_until_done()
        results.append([[t for o in outputs[f"r{i}"] for d in o.deltas for t in d.token_ids] for i in range(3)])
    assert all(len(tokens) == 8 for tokens in results[0])
    assert results[0] == results[1]


# bf16 through tl.dot comes out as garbage under Triton 3.6's interpreter (the decode kernel's
# too, while fp16 is right): the attention kernels are checked in fp32 and fp16 here, and in
# bf16 on the GPU (tests/gpu).
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_prefill_attention_equals_the_per_sequence_reference(dtype: torch.dtype) -> None:
    """Several prefilling sequences in one launch, against one SDPA each: a whole prompt, a
    chunk after cached keys (queries start mid-context), a one-query sequence, a prompt over
    several query tiles; pages scattered, GQA, q read from strided fused-qkv rows."""
    from engine_shim.engine.attention import AttnContext, SeqAttnInfo, paged_attention
    from engine_shim.engine.triton_prefill import PrefillRows, build_paged_prefill

    torch.manual_seed(3)
    hq, hkv, d, page_size, num_pages = 4, 2, 16, 4, 64
    k_cache = torch.randn(num_pages * page_size, hkv, d).to(dtype)
    v_cache = torch.randn(num_pages * page_size, hkv, d).to(dtype)
    shapes = [(13, 13), (5, 22), (1, 9), (70, 75)]  # (q_len, ctx_len)
    pages = torch.randperm(num_pages).tolist()
    rows, infos, q_start = [], [], 0
    for q_len, ctx_len in shapes:
        table = [pages.pop() for _ in range(-(-ctx_len // page_size))]
        slots = torch.tensor([table[p // page_size] * page_size + p % page_size for p in range(ctx_len)])
        rows.append(PrefillRows(q_start, q_len, ctx_len, table))
        infos.append(SeqAttnInfo(q_start, q_len, ctx_len, slots))
        q_start += q_len
    qkv = torch.randn(q_start, (hq + 2 * hkv) * d).to(dtype)
    q = qkv[:, : hq * d].view(q_start, hq, d)  # strided rows, as the model passes it
    scale = d**-0.5
    reference = paged_attention(
        q.float(), k_cache.float(), v_cache.float(),
        AttnContext(slot_mapping=torch.empty(0, dtype=torch.int64), seqs=infos), scale,
    )
    meta = build_paged_prefill(rows, page_size, torch.device("cpu"))
    assert meta.block_m == 64 and meta.tile_meta.shape[0] == 5  # 70 queries: two tiles
    out = paged_attention(q, k_cache, v_cache, AttnContext(
        slot_mapping=torch.empty(0, dtype=torch.int64), seqs=[], paged_prefill=meta), scale)
    torch.testing.assert_close(out.float(), reference, **tolerance(dtype))


def test_engine_on_the_paged_kernels_gives_the_reference_tokens() -> None:
    """The runner's CUDA path on the CPU: decode batches through the decode kernel, mixed
    steps (a prompt arriving while others decode, a chunked prompt, a prefix-cache hit)
    through both kernels; token-exact at temperature 0 against the reference ops. Pages of 4
    tokens and a 12-token chunk keep the prompts short: the interpreter runs one Python
    program per token row of every fused kernel."""
    from engine_shim.engine.api import GenerateOutput, SamplingParams
    from engine_shim.engine.config import EngineConfig
    from engine_shim.engine.disaggregation import EngineEvent
    from engine_shim.engine.llm_engine import LLMEngine

    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    shared = [(3 * j) % 250 + 1 for j in range(10)]
    prompts = [shared + [9, 8, 7], [(7 * j) % 250 + 1 for j in range(25)], shared + [1, 2]]
    results = []
    for paged in (True, False):
        engine = LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32", num_pages=64,
                                        page_size=4, prefill_chunk_size=12))
        assert engine.runner.use_paged_kernels  # Triton's interpreter stands in for CUDA
        engine.runner.use_paged_kernels = paged
        outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}

        def collect(events: list[EngineEvent], outputs: dict[str, list[int]] = outputs) -> None:
            for event in events:
                if isinstance(event, GenerateOutput):
                    outputs[event.request_id].extend(t for d in event.deltas for t in d.token_ids)

        engine.add_request("r0", prompts[0], short)
        for _ in range(2):  # r0 prefills (13 tokens: two chunks)
            collect(engine.step())
        engine.add_request("r1", prompts[1], sampling)  # chunked (25 tokens) while r0 decodes
        while len(outputs["r0"]) < 3:
            collect(engine.step())
        # r0 has ended, so its two full pages are in the prefix cache: r2 computes 4 tokens
        # after 8 cached ones, while r1 decodes.
        engine.add_request("r2", prompts[2], sampling)
        while engine.has_work:
            collect(engine.step())
        results.append(outputs)
        assert engine.block_manager.prefix_cache_stats().num_hit_tokens == 8
    assert [len(tokens) for tokens in results[0].values()] == [3, 12, 12]
    assert results[0] == results[1]


def test_static_mixed_steps_give_the_reference_tokens() -> None:
    """Steps that prefill in the static shapes of a captured graph (mixed_graphs.py, run
    eagerly here: capture needs CUDA): decode rows first, padding rows up to the bucket,
    empty query tiles, one block table for both kernels. A prompt arriving while others
    decode, a chunked prompt, a prefix-cache hit and a step too large for the buckets (the
    eager fallback) give the reference engine's tokens at temperature 0."""
    from engine_shim.engine.api import GenerateOutput, SamplingParams
    from engine_shim.engine.config import EngineConfig
    from engine_shim.engine.disaggregation import EngineEvent
    from engine_shim.engine.llm_engine import LLMEngine
    from engine_shim.engine.mixed_graphs import MixedGraphRunner

    sampling = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    shared = [(3 * j) % 250 + 1 for j in range(10)]
    prompts = [shared + [9, 8, 7], [(7 * j) % 250 + 1 for j in range(17)], shared + [1, 2], [5, 6]]
    results = []
    static_runs = []
    fallbacks: list[bool] = []  # per step that prefilled on the static runner: did not fit
    for static in (True, False):
        engine = LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32", num_pages=64,
                                        page_size=4, prefill_chunk_size=14))
        runner = engine.runner
        if static:
            runner.use_paged_kernels = True
            runner.mixed_graphs = MixedGraphRunner(
                engine.model, engine.kv_cache.kv, engine.page_size, engine.kv_cache.scratch_slot,
                max_tokens=18, max_decode_rows=4, max_pages_per_seq=16, max_prefills=2,
                buckets=(2, 4, 8, 16, 32),
            )
            assert runner.mixed_graphs.buckets == (2, 4, 8, 16, 18)
            fits = runner.mixed_graphs.fits

            def counted(step: Any, fits: Any = fits) -> bool:
                ok = bool(fits(step))
                fallbacks.append(not ok)
                return ok

            runner.mixed_graphs.fits = counted  # type: ignore[method-assign]
        else:
            runner.use_paged_kernels = False  # the reference ops
        outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}

        def collect(events: list[EngineEvent], outputs: dict[str, list[int]] = outputs) -> None:
            for event in events:
                if isinstance(event, GenerateOutput):
                    outputs[event.request_id].extend(t for d in event.deltas for t in d.token_ids)

        engine.add_request("r0", prompts[0], short)
        for _ in range(2):  # r0 prefills (13 tokens: bucket 16) and decodes alone
            collect(engine.step())
        engine.add_request("r1", prompts[1], sampling)  # chunked: 17 tokens, 14 a step
        while len(outputs["r0"]) < 3:  # r0's last decode beside r1's first chunk
            collect(engine.step())
        engine.add_request("r2", prompts[2], sampling)  # 8 tokens cached from r0, 4 to compute
        engine.add_request("r3", prompts[3], sampling)  # with r1's last 3 and r2's 4: eager
        while engine.has_work:
            collect(engine.step())
        results.append(outputs)
        assert engine.block_manager.prefix_cache_stats().num_hit_tokens == 8
        if static:
            assert runner.mixed_graphs is not None
            static_runs.append(runner.mixed_graphs.num_static_runs)
    assert [len(tokens) for tokens in results[0].values()] == [3, 10, 10, 10]
    assert results[0] == results[1]
    # The steps that prefill: r0 alone and r1's chunk beside r0's decode on the static shapes,
    # then three prompts in one step (more than max_prefills) eagerly.
    assert fallbacks == [False, False, True]
    assert static_runs == [2]
