"""Pattern comparison: round-robin vs disagg vs balanced (f=0.1) vs adaptive-disagg on stacks
started with `microserving up`, under a long-prompt workload at increasing request rates.

    microserving bench patterns --model llama-100m --rates 0.1 0.2 0.4 --out DIR

One stack per pattern (two engines: both-role for round-robin, 1 prefill + 1 decode for the
others); for each rate an open-loop run of the load generator (token-id prompts, exact
lengths, ignore_eos); then `compare` draws mean/p50/p90/p99 TTFT and JCT against rate.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path
from typing import Any

from bench.loadgen.benchmark import BenchConfig, run_benchmark, save_run
from bench.loadgen.compare import compare_runs, markdown_table
from bench.loadgen.runner import LoadShape
from bench.loadgen.workload import WorkloadConfig
from bench.procs import service_group

READY = re.compile(r"ready at (?P<url>\S+)")
# label -> `microserving up` flags
PATTERN_FLAGS: dict[str, list[str]] = {
    "round-robin": ["--pattern", "round-robin", "--engines", "2"],
    "disagg": ["--pattern", "disagg", "--prefill", "1", "--decode", "1"],
    "balanced-0.1": ["--pattern", "disagg", "--prefill", "1", "--decode", "1",
                     "--pd-balance-factor", "0.1"],
    "adaptive-disagg": ["--pattern", "adaptive-disagg", "--prefill", "1", "--decode", "1"],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="microserving bench patterns", allow_abbrev=False,
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-100m", help="engine model (preset or directory)")
    p.add_argument("--patterns", nargs="+", default=list(PATTERN_FLAGS), choices=PATTERN_FLAGS)
    p.add_argument("--rates", nargs="+", type=float, default=[0.1, 0.2, 0.4], help="req/s")
    p.add_argument("--duration-s", type=float, default=40.0,
                   help="offered-load duration per rate: num prompts = rate * duration")
    p.add_argument("--min-prompts", type=int, default=6)
    p.add_argument("--input-len", default="normal:512,64", help="prompt tokens (DIST)")
    p.add_argument("--output-len", default="32", help="output tokens (DIST)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--up-arg", action="append", default=[], help="extra flag for `up`")
    p.add_argument("--out", type=Path, required=True)
    return p


def _config(args: argparse.Namespace, base_url: str, label: str, rate: float) -> BenchConfig:
    workload = WorkloadConfig(input_len=args.input_len, output_len=args.output_len,
                              prompt_token_ids=True, tokenizer=args.model_tokenizer,
                              seed=args.seed)
    return BenchConfig(
        base_url=base_url, workload=workload,
        shape=LoadShape(request_rate=rate, seed=args.seed),
        num_prompts=max(args.min_prompts, round(rate * args.duration_s)),
        warmup=args.warmup, ignore_eos=True, label=label,
    )


async def _run_pattern(args: argparse.Namespace, label: str, base_url: str) -> list[dict[str, Any]]:
    results = []
    for rate in args.rates:
        result = await run_benchmark(_config(args, base_url, label, rate),
                                     command=["microserving", "bench", "patterns", *args.argv],
                                     show_progress=False)
        save_run(result, args.out / "runs" / label / f"rate_{rate:g}")
        s = result["summary"]
        print(f"  {label} @ {rate:g} req/s: {s['num_completed']} ok, {s['num_errors']} errors, "
              f"mean JCT {(s['jct_s'] or {}).get('mean', float('nan')):.2f} s", flush=True)
        results.append(result)
    return results


def run_patterns(args: argparse.Namespace) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for label in args.patterns:
        with service_group(args.out / "logs") as group:
            up = group.start(f"up-{label}", ["up", "--model", args.model, "--port", "0",
                                             "--router-port", "0", *PATTERN_FLAGS[label],
                                             *args.up_arg],
                             pattern=READY, timeout_s=900.0)
            assert up.found is not None  # start() raises when nothing was printed
            print(f"{label}: stack at {up.found['url']}", flush=True)
            results += asyncio.run(_run_pattern(args, label, up.found["url"]))
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    # Byte-level presets: token ids are the prompt's bytes. Other models: their own tokenizer.
    args.model_tokenizer = args.model
    results = run_patterns(args)
    compare_runs(results, args.out, f"patterns on {args.model}: input {args.input_len}, "
                 f"output {args.output_len} tokens")
    print(markdown_table(results), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
