"""`microserving bench`: benchmark any OpenAI-compatible server, and compare runs.

    microserving bench --base-url http://127.0.0.1:8000/v1 --request-rate 2 --num-prompts 50 \\
        --input-len 3000 --output-len 100 --ignore-eos --out runs/rate2
    microserving bench compare runs/rate1 runs/rate2 --out runs/compare

Also dispatches `microserving bench burst ...`, `microserving bench dos ...`, `microserving bench capacity ...`, `microserving bench control-plane ...`,
`microserving bench mlc-relay ...` and `microserving bench patterns ...`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
from pathlib import Path
from typing import Any

from bench.loadgen.benchmark import BenchConfig, run_and_save
from bench.loadgen.distributions import parse_length_dist
from bench.loadgen.runner import LoadShape
from bench.loadgen.workload import SHORT_CHAT_INPUT, SHORT_CHAT_OUTPUT, WorkloadConfig
from microserving.tokenizer import PRESET_NAMES

# Other benchmarks reachable as `microserving bench NAME ...`: module with main(argv).
SUBCOMMANDS = {
    "burst": "bench.burst",
    "capacity": "bench.capacity.cli",
    "compare": "bench.cli:compare_main",
    "control-plane": "bench.control_plane",
    "dos": "bench.dos_probe",
    "mlc-relay": "bench.mlc_relay",
    "patterns": "bench.patterns",
}


def _dist(text: str) -> str:
    try:
        parse_length_dist(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="microserving bench",
        description="Streaming load generator for OpenAI-compatible servers "
        "(subcommands: burst, capacity, compare, control-plane, dos, mlc-relay, patterns).",
        allow_abbrev=False,
    )
    p.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="model id (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, help="closed loop: requests kept in flight")
    load.add_argument("--request-rate", type=float, help="open loop: Poisson arrivals (req/s; inf)")
    p.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    p.add_argument("--num-prompts", type=int, default=100, help="measured requests")
    p.add_argument("--warmup", type=int, default=2, help="requests sent first and not counted")
    p.add_argument("--dataset", default="synthetic", help="synthetic | short-chat | FILE.jsonl")
    p.add_argument("--input-len", type=_dist, help="prompt tokens: N, normal:M,S or uniform:L,H "
                   f"(default 3000, less when the served context is shorter; short-chat "
                   f"{SHORT_CHAT_INPUT})")
    p.add_argument("--output-len", type=_dist, help="max_tokens per request, same syntax "
                   f"(default 100, less when the served context is shorter; short-chat "
                   f"{SHORT_CHAT_OUTPUT})")
    p.add_argument("--prompt-token-ids", action="store_true",
                   help="send prompts as token ids (exact lengths; completions endpoint)")
    p.add_argument("--tokenizer", help="cut prompts to exact lengths in this model's tokens: "
                   f"{' | '.join(PRESET_NAMES)} | a Hugging Face directory (default: the served "
                   "model's, when it is one of these)")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    p.add_argument("--extra-body", type=_json_object, default={},
                   help='JSON merged into every request, e.g. \'{"debug_config": {}}\'')
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request limit")
    p.add_argument("--label", default="run", help="name of this run in comparisons")
    p.add_argument("--out", type=Path, help="directory for results.json and cdf.png")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    is_chat_mix = args.dataset == "short-chat"
    workload = WorkloadConfig(
        dataset=args.dataset,
        input_len=args.input_len or (SHORT_CHAT_INPUT if is_chat_mix else "3000"),
        output_len=args.output_len or (SHORT_CHAT_OUTPUT if is_chat_mix else "100"),
        prompt_token_ids=args.prompt_token_ids,
        tokenizer=args.tokenizer,
        seed=args.seed,
    )
    shape = LoadShape(
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
    )
    return BenchConfig(
        base_url=args.base_url,
        workload=workload,
        shape=shape,
        model=args.model,
        endpoint=args.endpoint,
        num_prompts=args.num_prompts,
        warmup=args.warmup,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        timeout_s=args.timeout_s,
        label=args.label,
        extra_body=args.extra_body,
        fit_to_context=args.input_len is None and args.output_len is None,
    )


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.prompt_token_ids and (args.endpoint == "chat" or args.dataset == "short-chat"):
        parser.error("--prompt-token-ids needs --endpoint completions and a prompt dataset")
    if args.num_prompts < 1 or args.warmup < 0:
        parser.error("--num-prompts must be >= 1 and --warmup >= 0")
    if args.max_concurrency is not None and args.request_rate is None:
        parser.error("--max-concurrency applies to --request-rate only")


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"requests: {summary['num_completed']}/{summary['num_requests']} ok, "
        f"{summary['num_errors']} errors {summary['error_kinds'] or ''}".rstrip(),
        f"duration: {summary['duration_s']:.2f} s   requests/s: {summary['requests_per_s']:.2f}   "
        f"input tok/s: {summary['input_tokens_per_s']:.1f}   "
        f"output tok/s: {summary['output_tokens_per_s']:.1f}",
    ]
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("jct_s", "JCT")):
        f = summary.get(key)
        if f:
            lines.append(
                f"{name:<5} ms  mean {f['mean'] * 1e3:9.1f}  p50 {f['p50'] * 1e3:9.1f}  "
                f"p90 {f['p90'] * 1e3:9.1f}  p99 {f['p99'] * 1e3:9.1f}"
            )
    return "\n".join(lines)


def bench_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    try:
        config = config_from_args(args)
        result = run_and_save(
            config, args.out, command=["microserving", "bench", *argv],
            show_progress=not args.no_progress,
        )
    except (ValueError, OSError) as exc:
        print(f"microserving bench: {exc}", file=sys.stderr)
        return 1
    workload = result["config"]["workload"]
    print(f"workload: {workload['dataset']}, input {workload['input_len']}, output "
          f"{workload['output_len']} tokens"
          + (f" (in {workload['tokenizer']}'s tokens)" if workload["tokenizer"] else " (estimated)"))
    print(format_summary(result["summary"]))
    if args.out is not None:
        print(f"results: {args.out / 'results.json'}")
    return 0


def compare_main(argv: list[str]) -> int:
    from bench.loadgen.compare import compare_runs, markdown_table
    from bench.loadgen.results import read_results

    parser = argparse.ArgumentParser(prog="microserving bench compare", allow_abbrev=False,
                                     description="Plot runs side by side.")
    parser.add_argument("runs", nargs="+", type=Path, help="run directories or results.json files")
    parser.add_argument("--out", type=Path, required=True, help="directory for the plots")
    parser.add_argument("--title", default="", help="title of the plots")
    args = parser.parse_args(argv)
    try:
        results = [read_results(path) for path in args.runs]
        paths = compare_runs(results, args.out, args.title)
    except (ValueError, OSError) as exc:
        print(f"microserving bench compare: {exc}", file=sys.stderr)
        return 1
    print(markdown_table(results), end="")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _interrupt_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (a `timeout`, a job cancelled, a kill) ends a benchmark as Ctrl-C does, so its
    stack is stopped on the way out: Python's default would end the process at once and
    leave the services it started (each in a session of its own) running, and taking the
    CPU from whatever is measured next."""
    signal.raise_signal(signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    try:
        if args and args[0] in SUBCOMMANDS:
            module_name, _, func_name = SUBCOMMANDS[args[0]].partition(":")
            func = getattr(importlib.import_module(module_name), func_name or "main")
            return int(func(args[1:]) or 0)
        return bench_main(args)
    except KeyboardInterrupt:
        print("microserving bench: interrupted (what it started has been stopped)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
