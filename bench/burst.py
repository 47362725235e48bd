"""`microserving bench burst`: N clients at once, each streaming one completion through the
`openai` SDK (no retries), against a stack this starts with `microserving up` (embedded
`tiny` model, disagg by default) or against any --base-url. Prints how each request ended
(HTTP status, an error event mid-stream, no answer within --timeout-s), latency p50 / p99 of
the finished streams and of the refusals apart, and, for a stack it started, the peak RSS of
every process. Run it with and without an admission limit:

    microserving bench burst --max-inflight 64 --router-max-inflight 24
    microserving bench burst --max-inflight 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import psutil

from bench.loadgen.stats import percentile
from bench.procs import BASE_URL, service_group

SAMPLE_INTERVAL_S = 0.05


@dataclass
class Outcome:
    """How one request ended: "200", another status code, "stream error", "hang" or
    "connection error"; its latency (s) and, for a refusal, the error type."""

    kind: str
    latency_s: float
    error_type: str = ""


@dataclass
class PeakRss:
    """Peak RSS (bytes) per process of a process tree, sampled on a thread."""

    root_pid: int
    peak: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            with contextlib.suppress(psutil.Error):
                for process in psutil.Process(self.root_pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        name = _role(process.cmdline(), process.pid)
                        rss = process.memory_info().rss
                        self.peak[name] = max(self.peak.get(name, 0), rss)

    @contextlib.contextmanager
    def sampling(self) -> Iterator[PeakRss]:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()


def _role(cmdline: list[str], pid: int) -> str:
    for service in ("gateway", "router", "shim"):
        if service in cmdline:
            role = cmdline[cmdline.index("--role") + 1] if "--role" in cmdline else ""
            return f"{service}{'-' + role if role else ''}-{pid}"
    return f"{Path(cmdline[0]).name if cmdline else '?'}-{pid}"


async def _one(client: openai.AsyncOpenAI, model: str, index: int, args: argparse.Namespace) -> Outcome:
    started = time.perf_counter()

    async def stream() -> Outcome:
        try:
            chunks = await client.completions.create(
                model=model, prompt=f"burst client {index}: " + "x" * args.prompt_chars,
                max_tokens=args.max_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )
            async for _ in chunks:
                pass
        except openai.APIStatusError as error:
            body = error.body if isinstance(error.body, dict) else {}
            return Outcome(str(error.status_code), time.perf_counter() - started, str(body.get("type", "")))
        except openai.APIConnectionError:
            return Outcome("connection error", time.perf_counter() - started)
        except openai.APIError as error:  # an error event inside a 200 stream
            return Outcome("stream error", time.perf_counter() - started, str(error.type or ""))
        return Outcome("200", time.perf_counter() - started)

    try:
        return await asyncio.wait_for(stream(), args.timeout_s)
    except TimeoutError:
        return Outcome("hang", time.perf_counter() - started)


def _http_client(args: argparse.Namespace) -> Any:
    """The SDK's own HTTP client with room for every client's connection at once. Its HTTP
    library differs between SDK versions (httpx, httpx2): its Limits come from the same one."""
    library = sys.modules[openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0]]
    limits = library.Limits(max_connections=args.clients + 16, max_keepalive_connections=args.clients)
    return openai.DefaultAsyncHttpxClient(limits=limits, timeout=args.timeout_s)


async def burst(base_url: str, args: argparse.Namespace) -> tuple[list[Outcome], float]:
    async with _http_client(args) as http:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=args.api_key or "none",
                                    max_retries=0, http_client=http)
        model = (await client.models.list()).data[0].id
        started = time.perf_counter()
        outcomes = await asyncio.gather(*(_one(client, model, i, args) for i in range(args.clients)))
        return list(outcomes), time.perf_counter() - started


def summary(outcomes: list[Outcome], elapsed_s: float, rss: dict[str, int]) -> dict[str, Any]:
    kinds = Counter(o.kind for o in outcomes)
    result: dict[str, Any] = {
        "clients": len(outcomes), "elapsed_s": round(elapsed_s, 2), "outcomes": dict(kinds),
        "error_types": dict(Counter(f"{o.kind} {o.error_type}" for o in outcomes if o.error_type)),
    }
    for name, kind in (("finished", "200"), ("refused_429", "429")):
        latencies = [o.latency_s for o in outcomes if o.kind == kind]
        if latencies:
            result[f"{name}_p50_s"] = round(percentile(latencies, 50), 3)
            result[f"{name}_p99_s"] = round(percentile(latencies, 99), 3)
    if rss:
        result["peak_rss_mib"] = {name: round(b / 2**20) for name, b in sorted(rss.items())}
    return result


def _up_args(args: argparse.Namespace) -> list[str]:
    return ["up", "--model", args.model, "--pattern", args.pattern, "--port", "0",
            "--max-inflight", str(args.max_inflight), "--router-max-inflight", str(args.router_max_inflight),
            "--gateway-workers", str(args.gateway_workers), "--router-replicas", "1"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.base_url:
        outcomes, elapsed_s = asyncio.run(burst(args.base_url, args))
        return summary(outcomes, elapsed_s, {})
    with tempfile.TemporaryDirectory(prefix="microserving-burst-") as logs, \
            service_group(Path(logs)) as group:
        up = group.start("up", _up_args(args), pattern=BASE_URL)
        assert up.found is not None
        with PeakRss(up.process.pid).sampling() as rss:
            outcomes, elapsed_s = asyncio.run(burst(up.found["url"], args))
        return summary(outcomes, elapsed_s, rss.peak)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="microserving bench burst", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=1000, help="requests sent at once")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens each request streams")
    p.add_argument("--prompt-chars", type=int, default=64, help="characters after each prompt's prefix")
    p.add_argument("--timeout-s", type=float, default=300.0, help="a request unanswered by then is a hang")
    p.add_argument("--base-url", help="an OpenAI-compatible server's /v1 URL (else start `microserving up`)")
    p.add_argument("--api-key", help="bearer key for --base-url")
    p.add_argument("--model", default="tiny", help="model of the started stack")
    p.add_argument("--pattern", default="disagg", help="pattern of the started stack")
    p.add_argument("--max-inflight", type=int, default=64, help="gateway admission limit (0: none)")
    p.add_argument("--router-max-inflight", type=int, default=24, help="router admission limit (0: none)")
    p.add_argument("--gateway-workers", type=int, default=1, help="gateway worker processes")
    p.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    return p


def report(result: dict[str, Any], out: Path | None) -> None:
    """The figures as JSON on stdout, and in `out` too when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    report(result, args.out)
    return 0 if not {"hang", "404", "400", "500"} & set(result["outcomes"]) else 1
