"""The embedded engine on CUDA against `transformers` and the memory-bandwidth roofline.

Side by side in one run, on the same random bf16 weights (the `llama-1b` preset: hidden 2048,
16 layers, 32 query / 8 KV heads, vocab 32000):
- prefill tokens/s for 1k- and 8k-token prompts;
- decode tokens/s at batch 1, 32 and 128 with 512-token prompts and 128 new tokens;
- `transformers` generate with its dynamic and its static cache, same prompts and lengths;
- the decode roofline: bytes of weights + KV read per step / measured copy bandwidth.

Prints a table and writes JSON: `python -m bench.gpu_bench --out DIR`.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_shim.engine.api import GenerateOutput, SamplingParams
from engine_shim.engine.config import EngineConfig, resolve_model_config
from engine_shim.engine.llm_engine import LLMEngine
from engine_shim.engine.scheduler import ScheduledSeq

PROMPT_LEN = 512
NEW_TOKENS = 128


@dataclass
class Figure:
    system: str
    metric: str
    batch: int
    tokens_per_s: float

    def as_dict(self) -> dict[str, Any]:
        return {"system": self.system, "metric": self.metric, "batch": self.batch,
                "tokens_per_s": round(self.tokens_per_s, 1)}


def copy_bandwidth_gbps(num_bytes: int = 4 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written (median of 10)."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    median = sorted(times[3:])[len(times[3:]) // 2]
    del src, dst
    torch.cuda.empty_cache()
    return num_bytes / median / 1e9


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator).tolist()


def new_engine(model: str, max_batch: int) -> LLMEngine:
    config = EngineConfig(
        model=model, device="cuda", dtype="bfloat16", kv_cache_memory_mb=24 * 1024,
        max_num_seqs=max_batch, prefill_chunk_size=8192, enable_prefix_cache=False,
    )
    engine = LLMEngine(config)
    engine.warmup()
    return engine


def engine_prefill(engine: LLMEngine, length: int, repeats: int = 3) -> float:
    times = []
    for i in range(repeats + 1):
        (prompt,) = random_prompts(1, length, engine.vocab_size, seed=100 + i)
        sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.add_request(f"prefill-{length}-{i}", prompt, sampling)
        engine.run_until_done()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return length / sorted(times[1:])[len(times[1:]) // 2]


def engine_decode(engine: LLMEngine, batch: int, profile: bool = False, chain: bool = True) -> float:
    """Decode tokens/s once every sequence has its first token (prefill excluded); `chain`:
    with or without chained decode steps (EngineConfig.chain_decode)."""
    engine.chain_decode = chain
    chained_before = engine.num_chained_steps
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, PROMPT_LEN, engine.vocab_size, seed=batch)):
        engine.add_request(f"decode-{batch}-{i}", prompt, sampling)
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked) until every sequence sampled once
        for event in engine.step():
            if isinstance(event, GenerateOutput) and any(d.token_ids for d in event.deltas):
                started.add(event.request_id)
    # One plain step: collects the forward an overlapped step left in flight and allocates
    # the next position's page (a 512-token prompt fills its last one), so the forwards timed
    # below see every sequence at rest.
    overlap, engine.overlap_steps = engine.overlap_steps, False
    engine.step()
    engine.overlap_steps = overlap
    torch.cuda.synchronize()
    forward_s = _time_forwards(engine)
    if profile:
        _profile_forward(engine)
    start = time.perf_counter()
    num_tokens = num_steps = 0
    while engine.has_work:
        num_steps += 1
        for event in engine.step():
            num_tokens += sum(len(d.token_ids) for d in getattr(event, "deltas", ()))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    graphs = engine.runner.graphs
    print(f"  batch {batch}{'' if chain else ' unchained'}: {num_steps} steps, "
          f"{elapsed / num_steps * 1e3:.2f} ms/step, "
          f"forward (graph replay or eager, synchronised) {forward_s * 1e3:.2f} ms, "
          f"chained steps {engine.num_chained_steps - chained_before}, "
          f"graph replays so far {graphs.num_replays if graphs else 0}", flush=True)
    return num_tokens / elapsed


def _time_forwards(engine: LLMEngine, repeats: int = 20) -> float:
    """Median time of the model's decode forward alone for the running batch (no sampling,
    no scheduling), to split a step into device time and host overhead."""
    batch = _running_batch(engine)
    if not batch:
        return float("nan")
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.runner.run(batch, [False] * len(batch))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _running_batch(engine: LLMEngine) -> list[ScheduledSeq]:
    page_size = engine.page_size
    return [  # sequences whose pages already cover the next position
        ScheduledSeq(seq, 1) for seq in engine.scheduler.running
        if len(seq.block_table) * page_size > seq.num_computed_tokens
    ]


def _profile_forward(engine: LLMEngine, repeats: int = 5) -> None:
    """Kernel-level breakdown of the running batch's decode forward, eager (graphs off) so
    every kernel is attributed; then the same forward replayed from its graph, for the
    launch overhead the graph removes."""
    from torch.profiler import ProfilerActivity, profile

    batch = _running_batch(engine)
    if not batch:
        return
    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        engine.runner.run(batch, [False] * len(batch))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                engine.runner.run(batch, [False] * len(batch))
            torch.cuda.synchronize()
    finally:
        engine.runner.graphs = graphs
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in events) / repeats
    launches = sum(e.count for e in events) / repeats
    print(f"  profile batch {len(batch)}: {total_us / 1e3:.3f} ms of kernels in {launches:.0f} "
          f"launches per eager forward", flush=True)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"    {e.self_device_time_total / repeats:9.1f} us  x{e.count / repeats:5.0f}  {e.key[:90]}")


def sweep_attention_splits(engine: LLMEngine, batches: list[int], context: int) -> None:
    """The decode attention kernel alone (one layer, `context` keys a sequence over scattered
    pages of the engine's pool) at every split count, tile width and warp count, beside the
    configuration the engine runs (`launch_config`), for tuning it."""
    import triton.testing

    from engine_shim.engine.triton_attention import launch_config, paged_decode_attention

    mc, page = engine.model_config, engine.page_size
    kv = engine.kv_cache.kv
    pages_per_seq = -(-context // page)
    generator = torch.Generator().manual_seed(0)
    for batch in batches:
        if batch * pages_per_seq > engine.num_pages:
            continue
        order = torch.randperm(engine.num_pages, generator=generator)[: batch * pages_per_seq]
        tables = order.view(batch, pages_per_seq).to(device="cuda", dtype=torch.int32)
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, mc.num_heads, mc.head_dim, device="cuda", dtype=kv.dtype)
        kv_bytes = batch * context * 2 * mc.num_kv_heads * mc.head_dim * kv.element_size()
        picked = launch_config(batch, mc.num_kv_heads, "cuda")
        timings: list[tuple[float, int, int, int]] = []
        for splits in sorted({1, 2, 4, 8, picked.num_splits}):
            for block_n in (32, 64, 128):
                for warps in (2, 4, 8):
                    # Replayed from a CUDA graph, as the engine runs it: with plain do_bench
                    # the Python launch of the one or two kernels (20-60 us) hid the GPU time.
                    ms = triton.testing.do_bench_cudagraph(functools.partial(
                        paged_decode_attention, q, kv[0, 0], kv[0, 1], tables, lens, page,
                        mc.head_dim**-0.5, num_splits=splits, block_n=block_n, num_warps=warps))
                    timings.append((ms, splits, block_n, warps))
        engine_ms = next(t[0] for t in timings
                         if t[1:] == (picked.num_splits, picked.block_n, picked.num_warps))
        best = sorted(timings)[:4]
        cells = [f"splits {s} block {b} warps {w}: {ms * 1e3:.1f} us "
                 f"({kv_bytes / ms / 1e6:.0f} GB/s)" for ms, s, b, w in best]
        print(f"  attention sweep batch {batch}, context {context}: engine's (splits "
              f"{picked.num_splits}, block {picked.block_n}, warps {picked.num_warps}) "
              f"{engine_ms * 1e3:.1f} us ({kv_bytes / engine_ms / 1e6:.0f} GB/s); fastest: "
              + "; ".join(cells), flush=True)


def hf_model(engine: LLMEngine) -> Any:
    """transformers' LlamaForCausalLM holding the engine's exact weights (names match HF)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    mc = engine.model_config
    config = LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.head_dim, max_position_embeddings=mc.max_position_embeddings,
        rms_norm_eps=mc.rms_norm_eps, tie_word_embeddings=mc.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": mc.rope_theta},
    )
    with torch.device("cuda"):
        model: Any = LlamaForCausalLM(config)
    model = model.to(dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(engine.model.state_dict(), strict=False)
    if unexpected or any("rotary" not in name for name in missing):
        raise RuntimeError(f"weight names differ: missing {missing}, unexpected {unexpected}")
    return model.eval()


def hf_decode(model: Any, batch: int, cache: str, vocab: int) -> float:
    ids = torch.tensor(random_prompts(batch, PROMPT_LEN, vocab, seed=batch), device="cuda")
    kwargs: dict[str, Any] = {"do_sample": False, "pad_token_id": 0}
    if cache == "static":
        kwargs["cache_implementation"] = "static"

    def timed(new_tokens: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(2)  # warm up (static cache allocation)
    prefill_s = timed(1)
    total_s = timed(NEW_TOKENS)
    return batch * (NEW_TOKENS - 1) / max(total_s - prefill_s, 1e-9)


def hf_prefill(model: Any, length: int, vocab: int) -> float:
    ids = torch.tensor(random_prompts(1, length, vocab, seed=7), device="cuda")
    times = []
    for _ in range(4):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model(ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return length / sorted(times[1:])[1]


def roofline_tokens_per_s(engine: LLMEngine, batch: int, bandwidth_gbps: float) -> float:
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    mc = engine.model_config
    context = PROMPT_LEN + NEW_TOKENS // 2  # mean context over the decode phase
    kv_bytes = batch * context * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 2
    return batch / ((weight_bytes + kv_bytes) / (bandwidth_gbps * 1e9))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--prefill-lens", default="1024,8192")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--profile", action="store_true", help="kernel breakdown of each decode batch")
    parser.add_argument("--sweep-attention", action="store_true",
                        help="time the decode attention kernel at every split count")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    lengths = [int(n) for n in args.prefill_lens.split(",")]

    bandwidth = copy_bandwidth_gbps()
    print(f"copy bandwidth: {bandwidth:.0f} GB/s", flush=True)
    mc = resolve_model_config(args.model)
    print(f"model {args.model}: {mc.num_parameters / 1e9:.2f}B parameters", flush=True)
    engine = new_engine(args.model, max(batches))
    graphs = engine.runner.graphs
    print(f"decode: triton kernel {engine.runner.use_paged_kernels}, CUDA graphs for "
          f"batches {graphs.buckets if graphs else None}", flush=True)
    figures: list[Figure] = []
    for length in lengths:
        figures.append(Figure("engine", f"prefill_{length}", 1, engine_prefill(engine, length)))
        print(figures[-1].as_dict(), flush=True)
    for batch in batches:  # without chained steps first, then as the engine runs by default
        figures.append(Figure("engine-unchained", "decode", batch, engine_decode(engine, batch, chain=False)))
        print(figures[-1].as_dict(), flush=True)
        figures.append(Figure("engine", "decode", batch, engine_decode(engine, batch, args.profile)))
        print(figures[-1].as_dict(), flush=True)
    if args.sweep_attention:
        sweep_attention_splits(engine, batches, PROMPT_LEN + NEW_TOKENS // 2)
    roofline = {b: roofline_tokens_per_s(engine, b, bandwidth) for b in batches}
    if not args.skip_hf:
        model = hf_model(engine)
        del engine
        torch.cuda.empty_cache()
        for length in lengths:
            figures.append(Figure("transformers", f"prefill_{length}", 1,
                                  hf_prefill(model, length, mc.vocab_size)))
            print(figures[-1].as_dict(), flush=True)
        for cache in ("dynamic", "static"):
            for batch in batches:
                rate = hf_decode(model, batch, cache, mc.vocab_size)
                figures.append(Figure(f"transformers-{cache}", "decode", batch, rate))
                print(figures[-1].as_dict(), flush=True)
    result = {
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "model": args.model, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
        "copy_bandwidth_gbps": round(bandwidth, 1),
        "roofline_tokens_per_s": {str(b): round(r, 1) for b, r in roofline.items()},
        "figures": [f.as_dict() for f in figures],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_bench.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
