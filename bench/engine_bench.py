"""Embedded engine throughput on this machine, beside transformers `generate` on the same
weights: prefill tokens/s and decode tokens/s at batch 1, 16 and 64.

    PYTHONPATH=. python bench/engine_bench.py [--models tiny llama-100m] [--batches 1 16 64]

Prefill: B prompts of --prompt-len tokens, time to the first token. Decode: --decode-tokens
greedy tokens per request after that, timed per generated token (ignore_eos).
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine_shim.engine.api import GenerateOutput, SamplingParams
from engine_shim.engine.config import MODEL_PRESETS, EngineConfig
from engine_shim.engine.llm_engine import LLMEngine


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab, (batch, length), generator=generator).tolist()


def bench_engine(engine: LLMEngine, batch: int, prompt_len: int, decode_tokens: int) -> tuple[float, float]:
    params = SamplingParams(temperature=0, max_tokens=decode_tokens + 1, ignore_eos=True)
    prompts = _prompts(batch, prompt_len, 256)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{batch}-{i}", p, params)
    # Steps until every request has its first token = prefill.
    started: set[str] = set()
    while len(started) < batch:
        for event in engine.step():
            if isinstance(event, GenerateOutput) and any(d.token_ids for d in event.deltas):
                started.add(event.request_id)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    engine.run_until_done()
    decode_s = time.perf_counter() - start
    return batch * prompt_len / prefill_s, batch * decode_tokens / decode_s


def bench_hf(model: Any, batch: int, prompt_len: int, decode_tokens: int) -> tuple[float, float]:
    ids = torch.tensor(_prompts(batch, prompt_len, 256))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=decode_tokens + 1, min_new_tokens=decode_tokens + 1, do_sample=False)
        total_s = time.perf_counter() - start
    return batch * prompt_len / prefill_s, batch * decode_tokens / max(total_s - prefill_s, 1e-9)


def export_to_hf(engine: LLMEngine, out_dir: Path) -> torch.nn.Module:
    """The preset's exact weights as a transformers LlamaForCausalLM (names match 1:1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = engine.model_config
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, eos_token_id=None, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
    )
    model = LlamaForCausalLM(config)
    model.load_state_dict(engine.model.state_dict(), strict=False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["tiny", "llama-100m"], choices=list(MODEL_PRESETS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print("| model | params | batch | engine prefill tok/s | engine decode tok/s | HF prefill tok/s | HF decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        engine = LLMEngine(EngineConfig(model=name, max_num_seqs=max(args.batches), prefill_chunk_size=2048))
        engine.warmup()
        hf = None if args.no_hf else export_to_hf(engine, Path(tempfile.mkdtemp()))
        for batch in args.batches:
            ep, ed = bench_engine(engine, batch, args.prompt_len, args.decode_tokens)
            hp, hd = bench_hf(hf, batch, args.prompt_len, args.decode_tokens) if hf is not None else (float("nan"),) * 2
            params_m = engine.model_config.num_parameters / 1e6
            print(f"| {name} | {params_m:.0f}M | {batch} | {ep:,.0f} | {ed:,.0f} | {hp:,.0f} | {hd:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
