"""`microserving bench dos`: the one-request DoS probe. Starts `microserving up` (embedded
`tiny`) and, for each body size, posts one completion request whose body is that large (a
JSON prompt of 'a's, written whole before the answer is read, as the openai SDK's httpx
does) while a side client sends small streaming completions one after another through the
`openai` SDK. Prints, per size: the big request's status and seconds to its answer, the side
requests' latency median and worst while it ran next to their median alone, and the peak RSS
of every process. Run it with the gateway's body limit and with a limit above every size
(the router then refuses the prompt from its size, after the gateway has parsed it):

    microserving bench dos
    microserving bench dos --max-body-bytes 104857600
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from bench.burst import PeakRss, report
from bench.procs import BASE_URL, service_group

MB = 1024 * 1024
SIDE_MAX_TOKENS = 8
NUM_ALONE = 9  # side requests timed with nothing else running, per size


def _huge_body(num_bytes: int) -> bytes:
    head, tail = b'{"model": "tiny", "max_tokens": 4, "prompt": "', b'"}'
    return head + b"a" * (num_bytes - len(head) - len(tail)) + tail


async def _side_request_s(client: openai.AsyncOpenAI, model: str) -> float:
    started = time.perf_counter()
    stream = await client.completions.create(model=model, prompt="a side request", max_tokens=SIDE_MAX_TOKENS,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    async for _ in stream:
        pass
    return time.perf_counter() - started


async def _side_loop(client: openai.AsyncOpenAI, model: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        latencies.append(await _side_request_s(client, model))
    return latencies


async def _big_request(base_url: str, num_bytes: int) -> tuple[int, str, float]:
    """-> (status, error type of the answer, seconds from the start of the upload to the answer)."""
    body = _huge_body(num_bytes)
    async with httpx.AsyncClient(timeout=600) as http:
        started = time.perf_counter()
        reply = await http.post(f"{base_url}/completions", content=body,
                                headers={"content-type": "application/json"})
        answered_s = time.perf_counter() - started
    try:
        error_type = str(reply.json().get("error", {}).get("code") or reply.json().get("error", {}).get("type"))
    except (ValueError, AttributeError):
        error_type = ""
    return reply.status_code, error_type, answered_s


async def probe(base_url: str, sizes_mb: list[int]) -> list[dict[str, Any]]:
    rows = []
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id
        for size_mb in sizes_mb:
            alone = [await _side_request_s(client, model) for _ in range(NUM_ALONE)]
            stop = asyncio.Event()
            side = asyncio.ensure_future(_side_loop(client, model, stop))
            await asyncio.sleep(0.2)
            status, error_type, answered_s = await _big_request(base_url, size_mb * MB)
            await asyncio.sleep(0.2)
            stop.set()
            during = await side
            rows.append({
                "body_mb": size_mb, "status": status, "error": error_type, "answered_s": round(answered_s, 3),
                "side_alone_median_ms": round(statistics.median(alone) * 1e3, 1),
                "side_during_median_ms": round(statistics.median(during) * 1e3, 1),
                "side_during_worst_ms": round(max(during) * 1e3, 1), "side_during_count": len(during),
            })
    return rows


def _up_args(args: argparse.Namespace) -> list[str]:
    return ["up", "--model", "tiny", "--pattern", args.pattern, "--port", "0", "--router-port", "0",
            "--gateway-workers", "1", "--router-replicas", "1"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    limit = {"MICROSERVING_GATEWAY_MAX_BODY_BYTES": str(args.max_body_bytes)} if args.max_body_bytes else {}
    with tempfile.TemporaryDirectory(prefix="microserving-dos-") as logs, service_group(Path(logs)) as group:
        up = group.start("up", _up_args(args), pattern=BASE_URL, env={**os.environ, **limit})
        assert up.found is not None
        with PeakRss(up.process.pid).sampling() as rss:
            rows = asyncio.run(probe(up.found["url"], sizes))
    return {"max_body_bytes": args.max_body_bytes or "default", "rows": rows,
            "peak_rss_mib": {name: round(b / MB) for name, b in sorted(rss.peak.items())}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="microserving bench dos", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="5,20,50", help="body sizes to send, in MB, comma separated")
    p.add_argument("--max-body-bytes", type=int, default=0,
                   help="the gateway's body limit (MICROSERVING_GATEWAY_MAX_BODY_BYTES; 0: its default)")
    p.add_argument("--pattern", default="round-robin", help="pattern of the started stack")
    p.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report(run(args), args.out)
    return 0
