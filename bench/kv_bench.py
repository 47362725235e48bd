"""KV transfer throughput shim to shim on loopback: PrepRecv on D, RemoteSend on P (P computes
the prompt's KV, then pushes it to D's KVTransfer service), timed against a plain memory copy
of the same number of bytes. The RemoteSend time includes P's prefill, so the script also
times a second RemoteSend of the same prompt, whose KV comes from P's prefix cache, and
reports that as the transfer rate.

    PYTHONPATH=. python bench/kv_bench.py --model llama-100m --tokens 1024 8192
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.procs import ServiceGroup
from microserving.transport import TransportSettings, create_channel
from microserving.v1 import common_pb2, engine_pb2, engine_pb2_grpc


def _memcpy_gbps(num_bytes: int, repeats: int = 5) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return num_bytes * repeats / (time.perf_counter() - start) / 1e9


async def _transfer(p_stub, d_stub, request_id: str, tokens: list[int]) -> tuple[int, float]:
    sampling = common_pb2.SamplingParams(temperature=0.0)
    prep = await d_stub.PrepRecv(
        engine_pb2.PrepRecvRequest(
            request_id=request_id, token_ids=tokens, end=-1, sampling=sampling
        )
    )
    start = time.perf_counter()
    sent = await p_stub.RemoteSend(
        engine_pb2.RemoteSendRequest(
            request_id=request_id,
            token_ids=tokens,
            begin=prep.prefix_matched_length,
            end=prep.end,
            kv_addr_info=prep.kv_addr_info,
            sampling=sampling,
        )
    )
    elapsed = time.perf_counter() - start
    await d_stub.Abort(engine_pb2.AbortRequest(request_id=request_id))
    return int(sent.num_bytes_sent), elapsed


async def run(
    model: str, token_counts: list[int], num_pages: int, device: str = "cpu", dtype: str = "auto"
) -> list[dict[str, object]]:
    # P and D as separate shim processes, as deployed: the push crosses loopback TCP between
    # two Python processes. D has no prefix-cache hit: every run receives the whole window.
    common = ["--model", model, "--port", "0", "--num-pages", str(num_pages),
              "--reservation-ttl-s", "3600", "--device", device, "--dtype", dtype,
              "--log-level", "WARNING"]
    group = ServiceGroup(Path(tempfile.mkdtemp(prefix="kv_bench_")))
    try:
        p = group.start("prefill", ["shim", "--role", "prefill", *common])
        d = group.start("decode", ["shim", "--role", "decode", *common])
        return await _measure(p.address, d.address, model, device, token_counts)
    finally:
        group.close()


async def _measure(
    p_address: str, d_address: str, model: str, device: str, token_counts: list[int]
) -> list[dict[str, object]]:
    rows = []
    async with (
        create_channel(p_address, TransportSettings()) as pc,
        create_channel(d_address, TransportSettings()) as dc,
    ):
        p_stub, d_stub = engine_pb2_grpc.EngineStub(pc), engine_pb2_grpc.EngineStub(dc)
        for n in token_counts:
            # n + 1 prompt tokens, end=-1: the window is n tokens, whole pages when n is a
            # multiple of the page size, so after the cold run P's prefix cache holds all of
            # it and a warm RemoteSend computes nothing (a partial last page would be
            # recomputed every time and measured as transfer).
            tokens = [(i * 7919) % 256 for i in range(n + 1)]
            cold_bytes, cold_s = await _transfer(p_stub, d_stub, f"cold-{n}", tokens)
            # Warm runs take the KV from P's prefix cache: the transfer alone. Two untimed
            # ones first (gRPC's and malloc's buffers reach their steady size), then enough
            # for a median: about 1 GiB moved per size, at least 5 runs.
            for i in range(2):
                await _transfer(p_stub, d_stub, f"warmup-{n}-{i}", tokens)
            times, num_bytes = [], 0
            for i in range(max(5, (1 << 30) // max(1, cold_bytes))):
                num_bytes, elapsed = await _transfer(p_stub, d_stub, f"warm-{n}-{i}", tokens)
                times.append(elapsed)
            median_s, best_s = statistics.median(times), min(times)
            rows.append(
                row := {
                    "model": model,
                    "device": device,
                    "tokens": n,
                    "kv_mib": round(num_bytes / 2**20, 1),
                    "remote_send_with_prefill_s": round(cold_s, 3),
                    "runs": len(times),
                    "transfer_s": round(median_s, 4),
                    "transfer_gbps": round(num_bytes / median_s / 1e9, 2),
                    "best_transfer_gbps": round(num_bytes / best_s / 1e9, 2),
                    "memcpy_gbps": round(_memcpy_gbps(num_bytes), 2),
                }
            )
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-100m")
    # KV tokens moved (the prompt is one longer). 8176 = 511 pages of 16: the largest whole-page
    # window whose prompt fits the 8192-token context with a position left to generate.
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8176])
    parser.add_argument("--num-pages", type=int, default=1200)
    parser.add_argument("--device", default="cpu", help="cpu | cuda (KV moves device -> host -> device)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    rows = asyncio.run(run(args.model, args.tokens, args.num_pages, args.device, args.dtype))
    print(
        json.dumps(
            {
                "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
