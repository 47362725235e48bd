"""The engine against a reference no one here wrote: transformers on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_test_utils import random_prompt, tokens_of

from engine_shim.engine.api import SamplingParams
from engine_shim.engine.block_manager import num_pages_for
from engine_shim.engine.config import EngineConfig
from engine_shim.engine.llm_engine import LLMEngine
from engine_shim.engine.scheduler import ScheduledSeq
from engine_shim.engine.sequence import Sequence

pytestmark = pytest.mark.unit

NUM_DECODE_STEPS = 16


def _load_hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("fixture_name", ["hf_llama_dir", "hf_qwen2_dir", "hf_mistral_dir"])
def test_logits_match_transformers_over_prefill_and_decode(
    fixture_name: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(fixture_name)
    hf = _load_hf(path)
    engine = LLMEngine(EngineConfig(model=str(path), num_pages=64, page_size=4))
    prompt = random_prompt(7, 37)
    seq = Sequence(1, "parity", list(prompt), len(prompt))
    seq.block_table = engine.block_manager.allocate(num_pages_for(len(prompt) + NUM_DECODE_STEPS, 4))
    with torch.no_grad():
        hf_out = hf(torch.tensor([prompt]), use_cache=True)
    past = hf_out.past_key_values
    ours = engine.runner.run([ScheduledSeq(seq, len(prompt))], [True]).logits[0]
    seq.num_computed_tokens = len(prompt)
    hf_logits = hf_out.logits[0, -1]
    for _ in range(NUM_DECODE_STEPS):
        torch.testing.assert_close(ours, hf_logits, atol=1e-4, rtol=0)
        token = int(hf_logits.argmax())
        seq.token_ids.append(token)
        with torch.no_grad():
            hf_out = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, hf_logits = hf_out.past_key_values, hf_out.logits[0, -1]
        ours = engine.runner.run([ScheduledSeq(seq, 1)], [True]).logits[0]
        seq.num_computed_tokens += 1
    torch.testing.assert_close(ours, hf_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fixture_name", ["hf_llama_dir", "hf_qwen2_dir", "hf_mistral_dir"])
def test_greedy_equals_transformers_generate(fixture_name: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture_name)
    hf = _load_hf(path)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    prompt = random_prompt(11, 45)
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )[0, len(prompt):].tolist()
    # A small prefill chunk and page size exercise chunked prefill across page boundaries.
    engine = LLMEngine(EngineConfig(model=str(path), num_pages=64, page_size=4, prefill_chunk_size=16))
    engine.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert tokens_of(engine.run_until_done()["g"]) == expected
