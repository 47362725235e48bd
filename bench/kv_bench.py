"""KV transfer throughput shim to shim on one host: PrepRecv on D, RemoteSend on P (P computes
the prompt's KV, then pushes it to D's KVTransfer service), timed against a plain memory copy
of the same number of bytes, for both data paths side by side: `shm` (the KV goes through
D's shared-memory stage, only windows over gRPC) and `grpc` (the KV bytes in PushKV
messages over loopback TCP). The first RemoteSend includes P's prefill; the timed ones take
the KV from P's prefix cache, so they measure the transfer.

    PYTHONPATH=. python bench/kv_bench.py --model llama-100m --tokens 1024 8176
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
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


PATHS = ("shm", "grpc")


def _without_shm_offer(kv_addr_info: bytes) -> bytes:
    """The same reservation offered over gRPC only (what a receiver with --kv-shm false
    advertises), so both paths run between the same two processes, interleaved."""
    body = json.loads(kv_addr_info)
    body.pop("shm", None)
    return json.dumps(body).encode()


async def _transfer(
    p_stub, d_stub, request_id: str, tokens: list[int], path: str, num_sent: dict[str, int]
) -> tuple[int, float]:
    sampling = common_pb2.SamplingParams(temperature=0.0)
    prep = await d_stub.PrepRecv(
        engine_pb2.PrepRecvRequest(
            request_id=request_id, token_ids=tokens, end=-1, sampling=sampling
        )
    )
    kv_addr_info = prep.kv_addr_info
    if path == "grpc":
        kv_addr_info = _without_shm_offer(kv_addr_info)
    elif "shm" not in json.loads(kv_addr_info):
        raise RuntimeError("the receiver offered no shared memory (see its log)")
    start = time.perf_counter()
    sent = await p_stub.RemoteSend(
        engine_pb2.RemoteSendRequest(
            request_id=request_id,
            token_ids=tokens,
            begin=prep.prefix_matched_length,
            end=prep.end,
            kv_addr_info=kv_addr_info,
            sampling=sampling,
        )
    )
    elapsed = time.perf_counter() - start
    num_sent[path] += 1
    await d_stub.Abort(engine_pb2.AbortRequest(request_id=request_id))
    return int(sent.num_bytes_sent), elapsed


def _paths_logged(p_log: Path) -> dict[str, int]:
    """RemoteSends P logged per path (proof that the shm runs did not fall back to gRPC)."""
    text = p_log.read_text(encoding="utf-8") if p_log.exists() else ""
    return {path: len(re.findall(rf"path={path}\b", text)) for path in PATHS}


async def run(
    model: str, token_counts: list[int], num_pages: int, device: str = "cpu", dtype: str = "auto"
) -> list[dict[str, object]]:
    # P and D as separate shim processes, as deployed: the push crosses loopback TCP (or
    # shared memory) between two Python processes. D has no prefix-cache hit: every run
    # receives the whole window. P logs each RemoteSend's path at INFO.
    common = ["--model", model, "--port", "0", "--num-pages", str(num_pages),
              "--reservation-ttl-s", "3600", "--device", device, "--dtype", dtype]
    group = ServiceGroup(Path(tempfile.mkdtemp(prefix="kv_bench_")))
    try:
        p = group.start("prefill", ["shim", "--role", "prefill", *common, "--log-level", "INFO"])
        d = group.start("decode", ["shim", "--role", "decode", *common, "--log-level", "WARNING"])
        num_sent: dict[str, int] = {path: 0 for path in PATHS}
        rows = await _measure(p.address, d.address, model, device, token_counts, num_sent)
        await asyncio.sleep(0.5)  # P's log reaches its file through a pipe and a thread
        logged = _paths_logged(p.log_path)
        if logged != num_sent:
            raise RuntimeError(f"P logged RemoteSends by path {logged}, expected {num_sent}")
        return rows
    finally:
        group.close()


async def _measure(
    p_address: str,
    d_address: str,
    model: str,
    device: str,
    token_counts: list[int],
    num_sent: dict[str, int],
) -> list[dict[str, object]]:
    """Rows per size; `num_sent` counts the RemoteSends made per path."""
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
            cold_bytes, cold_s = await _transfer(
                p_stub, d_stub, f"cold-{n}", tokens, "grpc", num_sent
            )
            # Warm runs take the KV from P's prefix cache: the transfer alone. Two untimed
            # ones per path first (gRPC's and malloc's buffers, the shm stages and their
            # mappings reach their steady size), then the paths alternate run by run, so
            # both see the same load: about 1 GiB moved per path and size, >= 5 runs each.
            for i in range(2):
                for path in PATHS:
                    await _transfer(
                        p_stub, d_stub, f"warmup-{path}-{n}-{i}", tokens, path, num_sent
                    )
            times: dict[str, list[float]] = {path: [] for path in PATHS}
            num_bytes = 0
            for i in range(max(5, (1 << 30) // max(1, cold_bytes))):
                for path in PATHS:
                    num_bytes, elapsed = await _transfer(
                        p_stub, d_stub, f"warm-{path}-{n}-{i}", tokens, path, num_sent
                    )
                    times[path].append(elapsed)
            row: dict[str, object] = {
                "model": model,
                "device": device,
                "tokens": n,
                "kv_mib": round(num_bytes / 2**20, 1),
                "remote_send_with_prefill_s": round(cold_s, 3),
            }
            for path in PATHS:
                median_s, best_s = statistics.median(times[path]), min(times[path])
                row[f"{path}_runs"] = len(times[path])
                row[f"{path}_transfer_s"] = round(median_s, 4)
                row[f"{path}_gbps"] = round(num_bytes / median_s / 1e9, 2)
                row[f"{path}_best_gbps"] = round(num_bytes / best_s / 1e9, 2)
            row["memcpy_gbps"] = round(_memcpy_gbps(num_bytes), 2)
            rows.append(row)
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
