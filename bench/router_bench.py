"""Router overhead benchmark: added latency before the first token per pattern, and token
relay rate at several concurrencies, each against the same engines called directly, with a
raw grpc.aio echo round trip measured in the same run as the floor.

    python -m bench.router_bench [--samples 20] [--concurrency 1 64 256] [--out run.json]

Starts its own shims and routers (subprocesses, embedded tiny model). Direct baselines make
exactly the engine calls the router makes (StartGenerate for data parallel; PrepRecv,
RemoteSend, StartGenerate for disagg), so "added" is the router's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from microserving.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
_LISTENING = re.compile(r"listening on (\S+:\d+)")
_ECHO_METHOD = "/bench.Echo/Echo"

# pattern -> (router flags, roles of [engine 0, engine 1] given to the router, engine calls)
PATTERNS: dict[str, tuple[list[str], list[str], int]] = {
    "round-robin": (["--pattern", "round-robin"], ["both"], 1),
    "disagg": (["--pattern", "disagg"], ["prefill", "decode"], 3),
    "adaptive-disagg": (["--pattern", "adaptive-disagg"], ["prefill", "decode"], 3),
    "round-robin+cache-aware": (["--pattern", "round-robin", "--cache-aware"], ["both"], 1),
}


def _spawn(args: Sequence[str]) -> tuple[subprocess.Popen[str], str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env, cwd=REPO)
    assert proc.stdout is not None
    for line in proc.stdout:
        match = _LISTENING.search(line)
        if match:
            return proc, match.group(1)
    raise RuntimeError(f"{args} did not start")


def _shim(role: str) -> tuple[subprocess.Popen[str], str]:
    return _spawn(["-m", "microserving.cli", "shim", "--backend", "embedded", "--model", "tiny",
                   "--role", role, "--host", "127.0.0.1", "--port", "0"])


def _router(engines: Sequence[str], flags: Sequence[str]) -> tuple[subprocess.Popen[str], str]:
    args = ["-m", "microserving.cli", "router", "--model", "tiny", "--port", "0", "--log-level", "WARNING", *flags]
    for engine in engines:
        args += ["--engine", engine]
    return _spawn(args)


# ---- the floor: a raw grpc.aio unary echo in another process ----
async def _echo_server() -> None:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"echo listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


async def echo_rtt_s(address: str, samples: int) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(_ECHO_METHOD)
        payload = b"x" * 64
        for _ in range(20):
            await call(payload)
        times = []
        for _ in range(samples):
            start = time.perf_counter()
            await call(payload)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- first-token latency ----
def _prompt(rng: random.Random, length: int) -> list[int]:
    return [1, *(rng.randrange(32, 127) for _ in range(length - 1))]


def _sampling(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def direct_first_token_s(stubs: Sequence[engine_pb2_grpc.EngineStub], prompt: list[int], rid: str) -> float:
    """The router's engine calls made directly: [D] StartGenerate, or [P, D] the PD flow."""
    start = time.perf_counter()
    decode = stubs[-1]
    begin = 0
    if len(stubs) == 2:
        end = len(prompt) - 1
        prep = await decode.PrepRecv(engine_pb2.PrepRecvRequest(request_id=rid, token_ids=prompt, end=-1,
                                                               sampling=_sampling(1)))
        await stubs[0].RemoteSend(engine_pb2.RemoteSendRequest(
            request_id=rid, token_ids=prompt, begin=prep.prefix_matched_length, end=-1,
            kv_addr_info=prep.kv_addr_info, sampling=_sampling(1)))
        begin = end
    call = decode.StartGenerate(engine_pb2.StartGenerateRequest(request_id=rid, token_ids=prompt, begin=begin,
                                                                sampling=_sampling(1)))
    async for _ in call:
        elapsed = time.perf_counter() - start
        call.cancel()
        return elapsed
    raise RuntimeError("no token")


async def router_first_token_s(stub: router_pb2_grpc.RouterStub, prompt: list[int], rid: str) -> float:
    request = router_pb2.GenerateRequest(generate=router_pb2.NewRequest(
        request_id=rid, token_ids=router_pb2.TokenIds(ids=prompt), sampling=_sampling(1)))
    start = time.perf_counter()
    elapsed = None
    async for message in stub.Generate(iter([request])):
        if elapsed is None and message.HasField("delta"):
            elapsed = time.perf_counter() - start
    if elapsed is None:
        raise RuntimeError("no token through the router")
    return elapsed


# ---- relay rate ----
Arrivals = list[tuple[float, int]]  # (receive time, tokens in the message) of one stream


async def _direct_stream(stub: engine_pb2_grpc.EngineStub, prompt: list[int], rid: str, max_tokens: int) -> Arrivals:
    arrivals: Arrivals = []
    request = engine_pb2.StartGenerateRequest(request_id=rid, token_ids=prompt, sampling=_sampling(max_tokens))
    async for message in stub.StartGenerate(request):
        arrivals.append((time.perf_counter(), sum(len(c.token_ids) for c in message.choices)))
    return arrivals


async def _router_stream(stub: router_pb2_grpc.RouterStub, prompt: list[int], rid: str, max_tokens: int) -> Arrivals:
    arrivals: Arrivals = []
    request = router_pb2.GenerateRequest(generate=router_pb2.NewRequest(
        request_id=rid, token_ids=router_pb2.TokenIds(ids=prompt), sampling=_sampling(max_tokens)))
    async for message in stub.Generate(iter([request])):
        if message.HasField("delta"):
            arrivals.append((time.perf_counter(), len(message.delta.token_ids)))
    return arrivals


def steady_rate(streams: Sequence[Arrivals]) -> float:
    """Tokens per second while every stream is decoding: from the moment the last stream got
    its first token to the moment the first stream got its last one (so admission spread and
    the tail do not count); the whole run when that window is empty."""
    begin = max(s[0][0] for s in streams)
    end = min(s[-1][0] for s in streams)
    if end - begin < 1e-3:
        begin, end = min(s[0][0] for s in streams), max(s[-1][0] for s in streams)
    tokens = sum(n for s in streams for t, n in s if begin < t <= end)
    return tokens / (end - begin)


async def relay_rate(make_stream: Any, concurrency: int, max_tokens: int, rng: random.Random, tag: str) -> tuple[float, float]:
    """(steady-state tokens/s, whole-run tokens/s) of `concurrency` streams."""
    prompts = [_prompt(rng, 16) for _ in range(concurrency)]
    start = time.perf_counter()
    streams = await asyncio.gather(*(make_stream(p, f"{tag}-{i}", max_tokens) for i, p in enumerate(prompts)))
    whole = sum(n for s in streams for _, n in s) / (time.perf_counter() - start)
    return steady_rate(streams), whole


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    procs: list[subprocess.Popen[str]] = []
    try:
        echo_proc, echo_address = _spawn(["-m", "bench.router_bench", "--echo-server"])
        procs.append(echo_proc)
        shims = [_shim("both"), _shim("both")]
        procs += [p for p, _ in shims]
        addresses = [a for _, a in shims]
        channels = [grpc.aio.insecure_channel(a) for a in addresses]
        engine_stubs = [engine_pb2_grpc.EngineStub(c) for c in channels]
        rtt_s = await echo_rtt_s(echo_address, 300)
        status = await engine_stubs[0].GetStatus(engine_pb2.GetStatusRequest())
        report: dict[str, Any] = {"machine": _machine(), "engine_device": status.device,
                                  "echo_rtt_ms": rtt_s * 1e3, "patterns": {}, "relay": {}}
        for name, (flags, roles, num_calls) in PATTERNS.items():
            engines = [f"{a}={r}" for a, r in zip(addresses, roles, strict=False)]
            router_proc, router_address = _router(engines, flags)
            procs.append(router_proc)
            async with grpc.aio.insecure_channel(router_address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                await asyncio.sleep(1.5)  # first health round
                stubs = engine_stubs[: len(roles)] if len(roles) == 2 else [engine_stubs[0]]
                direct, routed = [], []
                for i in range(args.warmup + args.samples):
                    # Alternate which path goes first so drift and cache state hit both alike.
                    pair = [
                        direct_first_token_s(stubs, _prompt(rng, args.prompt_len), f"d-{name}-{i}"),
                        router_first_token_s(stub, _prompt(rng, args.prompt_len), f"r-{name}-{i}"),
                    ]
                    if i % 2:
                        r, d = await pair[1], await pair[0]
                    else:
                        d, r = await pair[0], await pair[1]
                    if i >= args.warmup:
                        direct.append(d)
                        routed.append(r)
                added_ms = (statistics.median(routed) - statistics.median(direct)) * 1e3
                report["patterns"][name] = {
                    "engine_calls": num_calls,
                    "direct_first_token_ms": statistics.median(direct) * 1e3,
                    "router_first_token_ms": statistics.median(routed) * 1e3,
                    "added_ms": added_ms,
                    "added_rtt_per_call": added_ms / (rtt_s * 1e3) / num_calls,
                }
                if name == "round-robin":
                    report["relay"] = await _relay(args, engine_stubs[0], stub, rng)
            router_proc.terminate()
            router_proc.wait(timeout=20)
            procs.remove(router_proc)
        for channel in channels:
            await channel.close()
        return report
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=20)


async def _relay(args: argparse.Namespace, engine: engine_pb2_grpc.EngineStub, router: router_pb2_grpc.RouterStub,
                 rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for concurrency in args.concurrency:
        direct, routed = [], []
        for rep in range(args.relay_repeats):  # alternate the paths; keep each one's best
            direct.append(await relay_rate(lambda p, r, m: _direct_stream(engine, p, r, m), concurrency,
                                           args.max_tokens, rng, f"dr{concurrency}-{rep}"))
            routed.append(await relay_rate(lambda p, r, m: _router_stream(router, p, r, m), concurrency,
                                           args.max_tokens, rng, f"rr{concurrency}-{rep}"))
        best_direct, best_routed = max(direct), max(routed)
        out[str(concurrency)] = {
            "direct_tokens_per_s": best_direct[0], "router_tokens_per_s": best_routed[0],
            "ratio": best_routed[0] / best_direct[0],
            "direct_whole_run_tokens_per_s": best_direct[1], "router_whole_run_tokens_per_s": best_routed[1],
            "whole_run_ratio": best_routed[1] / best_direct[1],
        }
    return out


def _machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def print_report(report: dict[str, Any]) -> None:
    print(f"machine: {report['machine']}; engines on {report['engine_device']}")
    print(f"raw grpc.aio unary echo round trip: {report['echo_rtt_ms']:.3f} ms")
    print(f"{'pattern':<26}{'calls':>6}{'direct ms':>11}{'router ms':>11}{'added ms':>10}{'RTT/call':>10}")
    for name, row in report["patterns"].items():
        print(f"{name:<26}{row['engine_calls']:>6}{row['direct_first_token_ms']:>11.2f}"
              f"{row['router_first_token_ms']:>11.2f}{row['added_ms']:>10.2f}{row['added_rtt_per_call']:>10.2f}")
    print(f"{'streams':<10}{'direct tok/s':>14}{'router tok/s':>14}{'ratio':>8}{'whole-run ratio':>17}")
    for concurrency, row in report["relay"].items():
        print(f"{concurrency:<10}{row['direct_tokens_per_s']:>14.0f}{row['router_tokens_per_s']:>14.0f}"
              f"{row['ratio']:>8.2f}{row['whole_run_ratio']:>17.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="router_bench", description=__doc__)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--relay-repeats", type=int, default=2)
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_server:
        asyncio.run(_echo_server())
        return 0
    report = asyncio.run(run(args))
    print_report(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
