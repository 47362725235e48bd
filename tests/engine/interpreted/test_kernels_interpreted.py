"""The Triton kernels of the CUDA path, run by Triton's CPU interpreter against the reference
torch ops they replace. Collected only with TRITON_INTERPRET=1 (the kernels are built as
interpreted functions at import); tests/engine/test_triton_interpreted.py runs this folder in
a subprocess with it set."""

from __future__ import annotations

import dataclasses
import os

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
