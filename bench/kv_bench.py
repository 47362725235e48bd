"""KV transfer throughput shim to shim on one host: PrepRecv on D, RemoteSend on P (P computes
the prompt's KV, then pushes it to D's KVTransfer service), timed against a plain memory copy
of the same number of bytes, for the data paths side by side: `nixl` (P writes its pool pages
straight into D's reserved slots through NIXL/UCX, after a WriteKV handshake), `shm` (the KV
goes through D's shared-memory stage, only windows over gRPC) and `grpc` (the KV bytes in
PushKV messages over loopback TCP). The first RemoteSend includes P's prefill; the timed ones
take the KV from P's prefix cache, so they measure the transfer. `nixl` is left out, with a
note, where NIXL does not load; where it runs, each row's `nixl_phases` splits its sends into
the phases P logs (hold, claim, transfer, confirm) and rates the transfer phase alone.
`--receiver-load N` keeps D's engine stepping through the sends (N greedy generations on it,
restarted as they end), as a decode engine is under serving load: a call that waits for D's
engine then waits for its step.

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
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import torch

import bench.grpc_first  # noqa: F401  (before gRPC loads: the stack's gRPC I/O stack)
from bench.procs import ServiceGroup
from microserving.transport import TransportSettings, create_channel
from microserving.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2
from router.endpoint import Endpoint
from router.engines import EngineStream


def _memcpy_gbps(num_bytes: int, repeats: int = 5) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return num_bytes * repeats / (time.perf_counter() - start) / 1e9


ALL_PATHS = ("nixl", "shm", "grpc")


def _offering_only(kv_addr_info: bytes, path: str) -> bytes:
    """The same reservation with only `path`'s offer left (gRPC needs none): what a receiver
    with that --kv-transport advertises, so every path runs between the same two processes,
    interleaved. P, on `auto`, takes NIXL, else shared memory, else gRPC."""
    body = json.loads(kv_addr_info)
    for offer in ("nixl", "shm"):
        if offer != path:
            body.pop(offer, None)
        elif offer not in body:
            raise RuntimeError(f"the receiver offered no {offer} (see its log)")
    return json.dumps(body).encode()


SEND_VIAS = ("unary", "stream")
RemoteSender = Callable[[engine_pb2.RemoteSendRequest], Awaitable[engine_pb2.RemoteSendResponse]]


class StreamSender:
    """RemoteSend as the router makes it to an engine whose status has serves_stream_calls:
    through the router's own EngineStream, a message on P's Engine.Generate stream answered
    by the call's one output (its error raised as the unary call's), not a unary call."""

    def __init__(self, p_address: str) -> None:
        self._endpoint = Endpoint(p_address, configured_roles=None)
        self._endpoint.connect(TransportSettings())
        self._stream = EngineStream(self._endpoint)

    async def __call__(self, request: engine_pb2.RemoteSendRequest) -> engine_pb2.RemoteSendResponse:
        message = engine_pb2.EngineGenerateRequest(remote_send=request)
        output = await self._stream.call(request.request_id, message, timeout_s=None)
        return output.remote_send

    async def close(self) -> None:
        await self._stream.close()
        if self._endpoint.channel is not None:
            await self._endpoint.channel.close()


async def _transfer(
    send: RemoteSender, d_stub, request_id: str, tokens: Sequence[int], path: str,
    num_sent: dict[str, int],
) -> tuple[int, float]:
    sampling = common_pb2.SamplingParams(temperature=0.0)
    prep = await d_stub.PrepRecv(
        engine_pb2.PrepRecvRequest(
            request_id=request_id, token_ids=tokens, end=-1, sampling=sampling
        )
    )
    kv_addr_info = _offering_only(prep.kv_addr_info, path)
    start = time.perf_counter()
    sent = await send(
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


# P's INFO line for a NIXL send (backend.py, WriteTimes): its time in P's backend (from the
# send's start there to the receiver's confirmation) and the phases of it.
_NIXL_SEND = re.compile(
    r"RemoteSend warm-nixl-(\d+)-\d+: \d+ tokens, (\d+) bytes .*? in ([\d.]+) ms \(hold ([\d.]+) "
    r"\(accepted at [\d.]+\), claim ([\d.]+), transfer ([\d.]+), confirm ([\d.]+) ms\), path=nixl"
)
_PHASES = ("send", "hold", "claim", "transfer", "confirm")


def nixl_phases(text: str) -> dict[int, dict[str, float]]:
    """Per window size (tokens), the timed NIXL sends' phases as P logged them: the median
    of each (ms; `send_ms` the whole send in P's backend, the four phases within it), and
    `write_gbps`, the bytes over the median transfer phase: the write itself (descriptors,
    NIXL's post and completion), without the engine's hold, the claim or the receiver's
    confirmation that the RemoteSend also waits for."""
    sends: dict[int, list[tuple[int, list[float]]]] = {}
    for match in _NIXL_SEND.finditer(text):
        size, num_bytes = int(match.group(1)), int(match.group(2))
        sends.setdefault(size, []).append((num_bytes, [float(g) for g in match.groups()[2:]]))
    result: dict[int, dict[str, float]] = {}
    for size, rows in sends.items():
        medians = {
            phase: statistics.median(times[i] for _, times in rows)
            for i, phase in enumerate(_PHASES)
        }
        summary = {f"{phase}_ms": round(ms, 2) for phase, ms in medians.items()}
        if medians["transfer"] > 0:
            summary["write_gbps"] = round(rows[0][0] / (medians["transfer"] / 1e3) / 1e9, 1)
        summary["sends"] = len(rows)
        result[size] = summary
    return result


def with_outside(split: dict[str, float], median_s: object) -> dict[str, float]:
    """`split` with `outside_ms`: the client's median RemoteSend less P's median send in its
    backend, what the call itself costs around the send (the request and its ids to P, P's
    checks before the send starts, the answer back), which no phase counts."""
    if not isinstance(median_s, float) or "send_ms" not in split:
        return split
    return {**split, "outside_ms": round(median_s * 1e3 - split["send_ms"], 2)}


def _paths_logged(text: str, paths: tuple[str, ...]) -> dict[str, int]:
    """RemoteSends P logged per path (proof that no run fell back to another path)."""
    return {path: len(re.findall(rf"path={path}\b", text)) for path in paths}


async def run(
    model: str,
    token_counts: list[int],
    num_pages: int,
    device: str = "cpu",
    dtype: str = "auto",
    paths: tuple[str, ...] = ALL_PATHS,
    engine_process: str = "auto",
    receiver_load: int = 0,
    load_via: str = "start-generate",
    nixl_local_copy: str = "true",
    send_via: str = "unary",
) -> list[dict[str, object]]:
    # P and D as separate shim processes, as deployed: the push crosses loopback TCP (or
    # shared memory) between two Python processes. D has no prefix-cache hit: every run
    # receives the whole window. P logs each RemoteSend's path at INFO.
    common = ["--model", model, "--port", "0", "--num-pages", str(num_pages),
              "--reservation-ttl-s", "3600", "--device", device, "--dtype", dtype]
    group = ServiceGroup(Path(tempfile.mkdtemp(prefix="kv_bench_")))
    try:
        # Where each shim's engine core runs (the shim's --engine-process; auto: a process of
        # its own on CUDA). NIXL's agent lives beside the pool either way (nixl_core.py).
        common += ["--engine-process", engine_process]
        # On one GPU a NIXL write is copies into D's pool mapped in P's core (CUDA IPC), NIXL
        # carrying its notification; false: NIXL's own transfer (pool_ipc.py).
        common += ["--kv-nixl-local-copy", nixl_local_copy]
        d = group.start("decode", ["shim", "--role", "decode", *common, "--log-level", "WARNING"])
        # P pushes only to peers it knows (issue 17): D, named up front.
        p = group.start("prefill", ["shim", "--role", "prefill", *common, "--log-level", "INFO",
                                    "--kv-peers", d.address])
        counted = tuple(dict.fromkeys([*paths, "grpc"]))  # the cold runs go over gRPC
        num_sent: dict[str, int] = {path: 0 for path in counted}
        rows = await _measure(p.address, d.address, model, device, token_counts, paths, num_sent,
                              receiver_load, load_via, send_via)
        await asyncio.sleep(0.5)  # P's log reaches its file through a pipe and a thread
        log = p.output()
        logged = _paths_logged(log, counted)
        if logged != num_sent:
            raise RuntimeError(f"P logged RemoteSends by path {logged}, expected {num_sent}")
        phases = nixl_phases(log)
        for row in rows:
            tokens = row["tokens"]
            if isinstance(tokens, int) and (split := phases.get(tokens)) is not None:
                row["nixl_phases"] = with_outside(split, row.get("nixl_transfer_s"))
        return rows
    finally:
        group.close()


async def _measure(
    p_address: str,
    d_address: str,
    model: str,
    device: str,
    token_counts: list[int],
    paths: tuple[str, ...],
    num_sent: dict[str, int],
    receiver_load: int = 0,
    load_via: str = "start-generate",
    send_via: str = "unary",
) -> list[dict[str, object]]:
    """Rows per size; `num_sent` counts the RemoteSends made per path. `send_via`: each
    RemoteSend a unary call, or a message on P's Engine.Generate stream (StreamSender)."""
    rows = []
    async with (
        create_channel(p_address, TransportSettings()) as pc,
        create_channel(d_address, TransportSettings()) as dc,
    ):
        p_stub, d_stub = engine_pb2_grpc.EngineStub(pc), engine_pb2_grpc.EngineStub(dc)
        if load_via == "stream":
            load = [asyncio.ensure_future(_keep_generating_on_stream(d_stub, receiver_load))]
        else:
            load = [asyncio.ensure_future(_keep_generating(d_stub, f"load-{i}"))
                    for i in range(receiver_load)]
        stream = StreamSender(p_address) if send_via == "stream" else None
        try:
            rows = await _measure_sizes(stream or p_stub.RemoteSend, d_stub, model, device,
                                        token_counts, paths, num_sent)
        finally:
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
            if stream is not None:
                await stream.close()
        for row in rows:
            row["receiver_load"] = receiver_load
            row["receiver_load_via"] = load_via
            row["send_via"] = send_via
    return rows


async def _keep_generating(d_stub, name: str) -> None:
    """Greedy generations on D, one after another, until cancelled."""
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    for i in range(1 << 30):
        request = engine_pb2.StartGenerateRequest(
            request_id=f"{name}-{i}", token_ids=[(7 * j + i) % 256 for j in range(32)],
            sampling=sampling,
        )
        async for _ in d_stub.StartGenerate(request):
            pass


async def _keep_generating_on_stream(d_stub, num_running: int) -> None:
    """`num_running` greedy generations on D at a time, as a router runs them: on one
    Engine.Generate stream, whose messages carry every request's output of a step (not a
    StartGenerate call per request, a message per token each); each one that ends is
    replaced, until cancelled."""
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    starts: asyncio.Queue[engine_pb2.EngineGenerateRequest] = asyncio.Queue()
    next_id = 0

    def start() -> None:
        nonlocal next_id
        request = engine_pb2.StartGenerateRequest(
            request_id=f"stream-load-{next_id}", sampling=sampling,
            token_ids=[(7 * j + next_id) % 256 for j in range(32)],
        )
        next_id += 1
        starts.put_nowait(engine_pb2.EngineGenerateRequest(start=request))

    async def requests():
        while True:
            yield await starts.get()

    for _ in range(num_running):
        start()
    call = d_stub.Generate(requests())
    async for message in call:
        for output in message.outputs:
            if output.HasField("error"):
                raise RuntimeError(f"receiver load failed: {output.error.message}")
            if output.HasField("usage"):
                start()


async def _measure_sizes(
    send: RemoteSender, d_stub, model: str, device: str, token_counts: list[int],
    paths: tuple[str, ...],
    num_sent: dict[str, int],
) -> list[dict[str, object]]:
    rows = []
    for n in token_counts:
        # n + 1 prompt tokens, end=-1: the window is n tokens, whole pages when n is a
        # multiple of the page size, so after the cold run P's prefix cache holds all of
        # it and a warm RemoteSend computes nothing (a partial last page would be
        # recomputed every time and measured as transfer).
        # Held as the router holds an attempt's prompt (EngineJob.wire_token_ids): one
        # message field that each call's ids are copied from, so a timed RemoteSend does not
        # also time building 8k ids from a list (0.2 ms), which no router call pays.
        tokens = router_pb2.TokenIds(ids=[(i * 7919) % 256 for i in range(n + 1)]).ids
        cold_bytes, cold_s = await _transfer(
            send, d_stub, f"cold-{n}", tokens, "grpc", num_sent
        )
        # Warm runs take the KV from P's prefix cache: the transfer alone. Two untimed
        # ones per path first (gRPC's and malloc's buffers, the shm stages and their
        # mappings reach their steady size), then the paths alternate run by run, so
        # both see the same load: about 1 GiB moved per path and size, >= 5 runs each.
        for i in range(2):
            for path in paths:
                await _transfer(
                    send, d_stub, f"warmup-{path}-{n}-{i}", tokens, path, num_sent
                )
        times: dict[str, list[float]] = {path: [] for path in paths}
        num_bytes = 0
        for i in range(max(5, (1 << 30) // max(1, cold_bytes))):
            for path in paths:
                num_bytes, elapsed = await _transfer(
                    send, d_stub, f"warm-{path}-{n}-{i}", tokens, path, num_sent
                )
                times[path].append(elapsed)
        row: dict[str, object] = {
            "model": model,
            "device": device,
            "tokens": n,
            "kv_mib": round(num_bytes / 2**20, 1),
            "remote_send_with_prefill_s": round(cold_s, 3),
        }
        for path in paths:
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
    parser.add_argument(
        "--device", default="cpu",
        help="cpu | cuda (nixl: device to device; shm: device -> host -> device)",
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--paths", nargs="+", choices=ALL_PATHS, default=list(ALL_PATHS))
    parser.add_argument("--engine-process", choices=("auto", "on", "off"), default="auto",
                        help="the shims' --engine-process")
    parser.add_argument("--nixl-local-copy", choices=("true", "false"), default="true",
                        help="the shims' --kv-nixl-local-copy: on one GPU, nixl writes as "
                             "copies into D's pool mapped in P's process (CUDA IPC)")
    parser.add_argument("--receiver-load", type=int, default=0,
                        help="greedy generations kept running on D through the sends")
    parser.add_argument("--receiver-load-via", choices=("start-generate", "stream"),
                        default="start-generate",
                        help="the load's calls: a StartGenerate each (a message per token "
                             "each), or one Engine.Generate stream as a router runs them "
                             "(every request's output of a step in one message)")
    parser.add_argument("--send-via", choices=SEND_VIAS, default="unary",
                        help="each RemoteSend a unary call, or a message on P's Engine.Generate "
                             "stream as the router makes it to engines that serve stream calls")
    args = parser.parse_args()
    paths = tuple(args.paths)
    if "nixl" in paths:
        from engine_shim.backends.embedded.kv_plane.nixl import load_nixl

        module, reason = load_nixl()
        if module is None:
            print(f"kv_bench: leaving out nixl: {reason}", file=sys.stderr)
            paths = tuple(p for p in paths if p != "nixl")
    rows = asyncio.run(
        run(args.model, args.tokens, args.num_pages, args.device, args.dtype, paths,
            args.engine_process, args.receiver_load, args.receiver_load_via, args.nixl_local_copy,
            args.send_via)
    )
    print(
        json.dumps(
            {
                "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
                "engine_process": args.engine_process,
                "nixl_local_copy": args.nixl_local_copy,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
