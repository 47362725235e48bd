"""Half-precision engines on the CPU: bf16 and fp16 weights and KV give the same tokens
through PD disaggregation as one engine of the same dtype alone, and stay close to fp32."""

from __future__ import annotations

import pytest
import torch
from engine_test_utils import GREEDY, generate_alone, random_prompt, tokens_of

from engine_shim.engine.api import SamplingParams
from engine_shim.engine.config import EngineConfig
from engine_shim.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.unit


def _engine(dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", dtype=dtype, num_pages=64))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_pd_is_token_exact_with_one_engine(dtype: str) -> None:
    prompt = random_prompt(21, 40)
    alone = generate_alone(_engine(dtype), "alone", prompt, GREEDY)
    prefill, decode = _engine(dtype), _engine(dtype)
    assert prefill.kv_cache.kv.dtype == getattr(torch, dtype)
    reserved = decode.prep_recv("pd", prompt, -1)
    for chunk in prefill.run_remote_send("pd", prompt, reserved.prefix_matched_length, reserved.end):
        decode.import_kv("pd", chunk)
    decode.start_generate("pd", prompt, reserved.end, GREEDY)
    assert tokens_of(decode.run_until_done()["pd"]) == alone


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_first_token_logits_track_fp32(dtype: str) -> None:
    prompt = random_prompt(22, 30)
    rows = {}
    for name in ("float32", dtype):
        engine = _engine(name)
        first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=True, top_logprobs=5)
        engine.add_request("r", prompt, first)
        (output,) = engine.run_until_done()["r"]
        rows[name] = output.deltas[0].logprobs[0]
    exact, half = rows["float32"], rows[dtype]
    # The random tiny model's logits are peaked (init_std 0.1): the half-precision argmax and
    # its log-probability agree with fp32 within the format's precision (bf16: 2^-8 relative).
    assert half.token_id == exact.token_id
    assert abs(half.logprob - exact.logprob) < 0.1
