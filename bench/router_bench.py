"""Router overhead benchmark: what the router adds before the first token per pattern, its
token relay rate at several concurrencies, and the router process's own CPU time per request
and per relayed token, each measured against the same engines called directly in the same
run, with a raw grpc.aio echo round trip as the floor.

Builds measured side by side on the same engines: `router` (this tree: decode over one
multiplexed Engine.Generate stream per engine), `router-startgenerate` (this tree with
`--no-engine-stream`: one StartGenerate call per request, the design before the stream) and,
on round-robin, the bare grpc.aio relay floor (bench/relay_floor.py). Two client modes on
`router`: one Router.Generate call per request (`router`), and every request on one long-lived
Router.Generate stream (`router-one-client-stream`: the API's many-requests-per-stream use,
no call setup per request).

    python -m bench.router_bench [--rounds 3] [--samples 40] [--concurrency 1 64 256]
    python -m bench.router_bench --baseline-tree /tmp/router-before   # before vs after, same run

Starts its own shims and routers (subprocesses, embedded tiny model). Direct baselines make
exactly the engine calls the router makes (StartGenerate for data parallel; PrepRecv,
RemoteSend, StartGenerate for disagg). Noise control, because the shims, the routers and this
client share the machine's cores:
- first token: direct and router requests are issued one at a time, interleaved in a rotating
  order, and "added" is the median of the per-pair differences (router_i - direct_i), so
  drift in the engines' speed cancels pair by pair;
- the router's own cost: its process CPU time (all threads) per request and per relayed
  token, which does not depend on how busy the engines are;
- every figure is the median over `--rounds` rounds (spread shown beside it);
- the engines run on the first half of the CPUs (torch threads to match) and the routers,
  the relay floor, the echo server and this client on the rest, as on a serving host where
  the router has cores of its own (`--no-pin`: everything shares every CPU);
- a relay batch is repeated until it has carried `--relay-min-tokens` tokens.
`--baseline-tree DIR` also starts a router from another source tree (e.g. `git worktree add
DIR HEAD~1`) on the same engines and interleaves it with the others: before and after side by
side under the same conditions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil

from bench.router_bench_report import print_report, summarize
from gateway.router_client import RouterClient
from microserving.transport import TransportSettings
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


@dataclass(frozen=True)
class CpuPlan:
    """Which CPUs the engines get and which the rest (routers, relay floor, echo server, this
    client): a serving host gives the router cores of its own, so its CPU is not taken from
    the engine it relays. Without it, on a small machine, every µs the router spends is a µs
    the engine loses, and the relay ratio measures CPU sharing rather than the router."""

    engines: frozenset[int]
    rest: frozenset[int]

    @staticmethod
    def split() -> CpuPlan | None:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            return None
        half = len(cpus) // 2
        return CpuPlan(frozenset(cpus[:half]), frozenset(cpus[half:]))


PLAN: CpuPlan | None = None  # set by run() unless --no-pin


def _spawn(args: Sequence[str], tree: Path = REPO, engine: bool = False) -> tuple[subprocess.Popen[str], str]:
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    cpus = None
    if PLAN is not None:
        cpus = PLAN.engines if engine else PLAN.rest
        if engine:  # torch's intra-op threads: one per CPU the engine owns
            env["OMP_NUM_THREADS"] = str(len(cpus))
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env, cwd=tree)
    if cpus is not None:
        # Pinned from here, not in a preexec_fn (unsafe in a process with gRPC's threads): the
        # child is still starting Python, and every thread it creates inherits the mask.
        os.sched_setaffinity(proc.pid, cpus)
    assert proc.stdout is not None
    for line in proc.stdout:
        match = _LISTENING.search(line)
        if match:
            return proc, match.group(1)
    raise RuntimeError(f"{args} did not start")


def _shim(role: str) -> tuple[subprocess.Popen[str], str]:
    return _spawn(["-m", "microserving.cli", "shim", "--backend", "embedded", "--model", "tiny",
                   "--role", role, "--host", "127.0.0.1", "--port", "0"], engine=True)


def _router(engines: Sequence[str], flags: Sequence[str], tree: Path = REPO) -> tuple[subprocess.Popen[str], str]:
    args = ["-m", "microserving.cli", "router", "--model", "tiny", "--port", "0", "--log-level", "WARNING", *flags]
    for engine in engines:
        args += ["--engine", engine]
    return _spawn(args, tree)


def cpu_s(pid: int) -> float:
    """CPU time the process has used so far, all threads: the scheduler's nanosecond count
    (/proc/PID/task/*/schedstat) where Linux has it, else user + system time, which is counted
    in clock ticks (10 ms) and too coarse for one request."""
    try:
        total_ns = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that just ended
                total_ns += int((task / "schedstat").read_text().split()[0])
        return total_ns / 1e9
    except OSError:
        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)


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


async def _shared_events(shared: RouterClient, request: router_pb2.NewRequest
                         ) -> AsyncIterator[router_pb2.GenerateResponse]:
    """One request on the client's one long-lived Router.Generate call (the gateway's client,
    held to a single call), as the API is meant to be used by a client that keeps its
    connection (many requests per stream, tagged by id): no call setup per request."""
    async with shared.open_stream() as stream:
        await stream.start([request])
        async for message in stream.events():
            yield message


async def shared_first_token_s(shared: RouterClient, prompt: list[int], rid: str) -> float:
    request = router_pb2.NewRequest(request_id=rid, token_ids=router_pb2.TokenIds(ids=prompt), sampling=_sampling(1))
    start = time.perf_counter()
    elapsed = None
    async for message in _shared_events(shared, request):
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


async def _shared_stream(shared: RouterClient, prompt: list[int], rid: str, max_tokens: int) -> Arrivals:
    arrivals: Arrivals = []
    request = router_pb2.NewRequest(request_id=rid, token_ids=router_pb2.TokenIds(ids=prompt),
                                    sampling=_sampling(max_tokens))
    async for message in _shared_events(shared, request):
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


StreamFn = Callable[[list[int], str, int], Awaitable[Arrivals]]


async def relay_rate(make_stream: StreamFn, concurrency: int, max_tokens: int, rng: random.Random,
                     tag: str) -> tuple[float, float, int]:
    """(steady-state tokens/s, whole-run tokens/s, tokens) of `concurrency` streams."""
    prompts = [_prompt(rng, 16) for _ in range(concurrency)]
    start = time.perf_counter()
    streams = await asyncio.gather(*(make_stream(p, f"{tag}-{i}", max_tokens) for i, p in enumerate(prompts)))
    num_tokens = sum(n for s in streams for _, n in s)
    return steady_rate(streams), num_tokens / (time.perf_counter() - start), num_tokens


# ---- one run ----
@dataclass
class RouterUnderTest:
    """A router process (this tree's or the baseline tree's) and its stub."""

    build: str
    proc: subprocess.Popen[str]
    channel: grpc.aio.Channel
    stub: router_pb2_grpc.RouterStub
    shared: RouterClient | None = None  # this router again, every request on one client stream


def _rotated(items: list[Any], turn: int) -> list[Any]:
    turn %= len(items)
    return items[turn:] + items[:turn]


async def first_token_round(
    direct_stubs: Sequence[engine_pb2_grpc.EngineStub], routers: Sequence[RouterUnderTest],
    rng: random.Random, samples: int, warmup: int, prompt_len: int, tag: str,
) -> dict[str, Any]:
    """`samples` interleaved tuples (direct, each router), fresh prompts, rotating order."""
    builds = [b for r in routers for b in (r.build, SHARED if r.shared else None) if b]
    times: dict[str, list[float]] = {"direct": [], **{b: [] for b in builds}}
    cpu = dict.fromkeys(times, 0.0)
    for i in range(warmup + samples):
        calls: list[tuple[str, Callable[[], Awaitable[float]], int | None]] = [
            ("direct", functools.partial(direct_first_token_s, direct_stubs, _prompt(rng, prompt_len),
                                         f"d-{tag}-{i}"), None)
        ]
        for r in routers:
            call = functools.partial(router_first_token_s, r.stub, _prompt(rng, prompt_len), f"{r.build}-{tag}-{i}")
            calls.append((r.build, call, r.proc.pid))
            if r.shared is not None:
                call = functools.partial(shared_first_token_s, r.shared, _prompt(rng, prompt_len), f"s-{tag}-{i}")
                calls.append((SHARED, call, r.proc.pid))
        for name, timed_call, pid in _rotated(calls, i):
            before = cpu_s(pid) if pid else 0.0
            elapsed = await timed_call()
            if i >= warmup:
                times[name].append(elapsed)
                if pid:
                    cpu[name] += cpu_s(pid) - before
    out: dict[str, Any] = {"direct_ms": statistics.median(times["direct"]) * 1e3}
    for build in builds:
        pairs = [a - b for a, b in zip(times[build], times["direct"], strict=True)]
        out[build] = {"router_ms": statistics.median(times[build]) * 1e3,
                      "added_ms": statistics.median(pairs) * 1e3,
                      "cpu_ms_per_request": cpu[build] / samples * 1e3}
    return out


async def relay_round(engine: engine_pb2_grpc.EngineStub, engine_pid: int, routers: Sequence[RouterUnderTest],
                      concurrency: int, max_tokens: int, rng: random.Random, tag: str, turn: int,
                      min_tokens: int) -> dict[str, Any]:
    """Direct and each router's streams, one batch of `concurrency` streams after the other in
    a rotating order, repeated until each has relayed `min_tokens` (a single 64-token stream
    lasts a fifth of a second: one batch alone is mostly noise); rates are the median over the
    repeats, the ratio the median of each repeat's router/direct pair. The engine's CPU per
    token of the direct run is the yardstick for the router's."""
    runs: list[tuple[str, StreamFn, int | None]] = [("direct", functools.partial(_direct_stream, engine), None)]
    for router in routers:
        runs.append((router.build, functools.partial(_router_stream, router.stub), router.proc.pid))
        if router.shared is not None:
            runs.append((SHARED, functools.partial(_shared_stream, router.shared), router.proc.pid))
    repeats = max(1, -(-min_tokens // (concurrency * max_tokens)))
    figures: dict[str, dict[str, list[float]]] = {name: {"steady": [], "whole": [], "cpu_s": [], "tokens": []}
                                                  for name, _, _ in runs}
    for repeat in range(repeats):
        for name, stream, pid in _rotated(runs, turn + repeat):
            before = cpu_s(pid or engine_pid)
            steady, whole, num_tokens = await relay_rate(stream, concurrency, max_tokens, rng,
                                                         f"{name}-{tag}-{repeat}")
            row = figures[name]
            row["cpu_s"].append(cpu_s(pid or engine_pid) - before)
            row["steady"].append(steady)
            row["whole"].append(whole)
            row["tokens"].append(num_tokens)
    out: dict[str, Any] = {}
    direct = figures["direct"]
    for name, row in figures.items():
        out[name] = {"tokens_per_s": statistics.median(row["steady"]),
                     "whole_run_tokens_per_s": statistics.median(row["whole"]),
                     "cpu_us_per_token": sum(row["cpu_s"]) / sum(row["tokens"]) * 1e6, "repeats": repeats}
        if name != "direct":
            out[name]["ratio"] = statistics.median(a / b for a, b in zip(row["steady"], direct["steady"], strict=True))
    return out


FLOOR = "grpc-relay-floor"
PER_CALL = "router-startgenerate"
SHARED = "router-one-client-stream"


async def _start_routers(builds: dict[str, tuple[Path, list[str]]], engines: list[str], flags: list[str],
                         with_floor: bool) -> list[RouterUnderTest]:
    launched = [(build, *_router(engines, [*flags, *extra], tree)) for build, (tree, extra) in builds.items()]
    if with_floor:
        floor_args = ["-m", "bench.relay_floor", *(f"--engine={e}" for e in engines)]
        launched.append((FLOOR, *_spawn(floor_args)))
    routers = []
    for build, proc, address in launched:
        channel = grpc.aio.insecure_channel(address)
        stub = router_pb2_grpc.RouterStub(channel)
        shared = RouterClient(address, TransportSettings(), max_calls=1) if build == "router" else None
        routers.append(RouterUnderTest(build, proc, channel, stub, shared))
    await asyncio.sleep(1.5)  # first health round
    return routers


async def _stop_routers(routers: Sequence[RouterUnderTest]) -> None:
    for r in routers:
        if r.shared is not None:
            await r.shared.close()
        await r.channel.close()
        r.proc.terminate()
        r.proc.wait(timeout=20)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    global PLAN
    PLAN = None if args.no_pin else CpuPlan.split()
    if PLAN is not None:
        os.sched_setaffinity(0, PLAN.rest)
    rng = random.Random(0)
    # This tree's router on the engines' multiplexed Generate stream, and forced onto one
    # StartGenerate call per request: old and new relay in the same run.
    builds: dict[str, tuple[Path, list[str]]] = {"router": (REPO, [])}
    if not args.no_per_call:
        builds[PER_CALL] = (REPO, ["--no-engine-stream"])
    if args.baseline_tree:
        builds["baseline"] = (Path(args.baseline_tree).resolve(), [])
    procs: list[subprocess.Popen[str]] = []
    try:
        echo_proc, echo_address = _spawn(["-m", "bench.router_bench", "--echo-server"])
        procs.append(echo_proc)
        shims = [_shim("both"), _shim("both")]
        procs += [p for p, _ in shims]
        addresses = [a for _, a in shims]
        channels = [grpc.aio.insecure_channel(a) for a in addresses]
        engine_stubs = [engine_pb2_grpc.EngineStub(c) for c in channels]
        status = await engine_stubs[0].GetStatus(engine_pb2.GetStatusRequest())
        report: dict[str, Any] = {"machine": "", "engine_device": status.device, "builds": [*builds, SHARED, FLOOR],
                                  "cpus": ({"engines": sorted(PLAN.engines), "routers_and_clients": sorted(PLAN.rest)}
                                           if PLAN else "all shared"),
                                  "rounds": args.rounds, "echo_rtt_ms": [], "patterns": {}, "relay": {}}
        for name in args.patterns:
            flags, roles, num_calls = PATTERNS[name]
            engines = [f"{a}={r}" for a, r in zip(addresses, roles, strict=False)]
            routers = await _start_routers(builds, engines, flags, with_floor=name == "round-robin")
            stubs = engine_stubs[: len(roles)] if len(roles) == 2 else [engine_stubs[0]]
            rounds = []
            for rnd in range(args.rounds):
                report["echo_rtt_ms"].append(await echo_rtt_s(echo_address, 200) * 1e3)
                rounds.append(await first_token_round(stubs, routers, rng, args.samples, args.warmup,
                                                      args.prompt_len, f"{name}-{rnd}"))
            report["patterns"][name] = {"engine_calls": num_calls, "rounds": rounds}
            if name == "round-robin":
                for concurrency in args.concurrency:
                    report["relay"][str(concurrency)] = [
                        await relay_round(engine_stubs[0], shims[0][0].pid, routers, concurrency, args.max_tokens, rng,
                                          f"c{concurrency}-{rnd}", rnd, args.relay_min_tokens)
                        for rnd in range(args.rounds)
                    ]
            await _stop_routers(routers)
        for channel in channels:
            await channel.close()
        report["machine"] = _machine()
        return report
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=20)


def _machine() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (load average {load} at the "
            f"end), {platform.system()} {platform.release()}, Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="router_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=40, help="first-token pairs per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--relay-min-tokens", type=int, default=2048,
                        help="repeat each relay batch until it has carried this many tokens")
    parser.add_argument("--patterns", nargs="+", choices=list(PATTERNS), default=list(PATTERNS))
    parser.add_argument("--baseline-tree", help="also measure a router started from this source tree")
    parser.add_argument("--no-per-call", action="store_true",
                        help="skip the router forced onto one StartGenerate call per request (--no-engine-stream)")
    parser.add_argument("--no-pin", action="store_true",
                        help="leave every process on every CPU (default: engines on the first half of the CPUs, "
                             "routers and clients on the rest)")
    parser.add_argument("--out", help="write every round's figures as JSON here")
    parser.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_server:
        asyncio.run(_echo_server())
        return 0
    report = asyncio.run(run(args))
    print_report(report)
    if args.out:
        Path(args.out).write_text(json.dumps({**report, "summary": summarize(report)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
