"""Fixtures of the shim tests: shims started through the real entry point
(`python -m microserving.cli shim ... --port 0`, port read from its `listening on` line, through
microserving.stack.process) and
small gRPC helpers. The session-scoped P and D shims are shared by every test that leaves
them as it found them (free pages back at baseline)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from grpc import aio

from engine_shim.backends.embedded.kv_plane.addr import ShmOffer
from engine_shim.backends.embedded.kv_plane.codec import bytes_per_token, staged_chunk
from engine_shim.backends.embedded.kv_plane.shm import SegmentMaps, host_identity
from engine_shim.engine.api import KVLayout
from microserving.stack.process import ServiceProcess
from microserving.transport import TransportSettings, create_channel
from microserving.v1 import common_pb2, engine_pb2, engine_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0

# A prompt of 50 byte tokens (ids 10..59): spans 4 pages of 16.
PROMPT = list(range(10, 60))


def greedy(max_tokens: int = 16) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MICROSERVING_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")  # several engines share two cores in CI
    return env


class ShimProcess(ServiceProcess):
    """`python -m microserving.cli ARGS`, started and listening; its output in `log_path`."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        prefix: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """`prefix` runs the process through another command (e.g. `ip netns exec NS`, which
        execs it, so the pid stays the service's); `env` adds variables."""
        super().__init__(
            log_path.stem, [*prefix, sys.executable, "-m", "microserving.cli", *args],
            log_path=log_path, env={**subprocess_env(), **(env or {})}, cwd=REPO_ROOT,
        )
        self.wait_listening(STARTUP_TIMEOUT_S)

    def log_text(self) -> str:
        return self.output()


async def until_none(queue: asyncio.Queue[engine_pb2.EngineGenerateRequest | None]
                     ) -> AsyncIterator[engine_pb2.EngineGenerateRequest]:
    """A caller's Engine.Generate messages as a test puts them in `queue`; None half-closes."""
    while (message := await queue.get()) is not None:
        yield message


def start_shim(tmp_dir: Path, name: str, *extra: str) -> ShimProcess:
    args = ["shim", "--backend", "embedded", "--model", "tiny", "--port", "0", *extra]
    return ShimProcess(args, tmp_dir / f"{name}.log")


@pytest.fixture(scope="session")
def prefill_shim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShimProcess]:
    shim = start_shim(tmp_path_factory.mktemp("shims"), "prefill", "--role", "prefill")
    yield shim
    shim.stop()


@pytest.fixture(scope="session")
def decode_shim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShimProcess]:
    shim = start_shim(tmp_path_factory.mktemp("shims"), "decode", "--role", "decode")
    yield shim
    shim.stop()


@pytest.fixture(scope="session")
def process_core_shims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ShimProcess]]:
    """A prefill and a decode shim whose engine cores (and NIXL agents, where NIXL loads) run
    in processes of their own (`--engine-process on`, nixl_core.py)."""
    tmp = tmp_path_factory.mktemp("process-core")
    shims = {role: start_shim(tmp, f"{role}-process", "--role", role, "--engine-process", "on")
             for role in ("prefill", "decode")}
    yield shims
    for shim in shims.values():
        shim.stop()


def engine_stub(address: str) -> tuple[aio.Channel, engine_pb2_grpc.EngineAsyncStub]:
    channel = create_channel(address, TransportSettings())
    return channel, engine_pb2_grpc.EngineStub(channel)  # type: ignore[return-value]


async def generate(
    stub: engine_pb2_grpc.EngineAsyncStub,
    request_id: str,
    token_ids: list[int],
    begin: int = 0,
    sampling: common_pb2.SamplingParams | None = None,
) -> list[int]:
    request = engine_pb2.StartGenerateRequest(
        request_id=request_id, token_ids=token_ids, begin=begin, sampling=sampling or greedy()
    )
    ids: list[int] = []
    async for response in stub.StartGenerate(request):
        for choice in response.choices:
            ids.extend(choice.token_ids)
    return ids


async def generate_alone(address: str, request_id: str, tokens: list[int]) -> list[int]:
    """One shim alone (the reference of the PD tests)."""
    channel, stub = engine_stub(address)
    async with channel:
        return await generate(stub, request_id, tokens)


async def introduce(sender: engine_pb2_grpc.EngineStub, *peers: str) -> None:
    """Tell a shim its KV peers, as a router's status poll does (a shim pushes KV to no one
    else; engine_shim/backends/embedded/kv_plane/peers.py)."""
    await sender.GetStatus(engine_pb2.GetStatusRequest(kv_peers=list(peers)))


async def pd_flow(
    prefill_address: str, decode_address: str, request_id: str, tokens: list[int], end: int = -1
) -> tuple[list[int], engine_pb2.PrepRecvResponse, engine_pb2.RemoteSendResponse | None]:
    """MLC's PD flow between two shims: PrepRecv on D, RemoteSend on P (skipped when D's
    prefix cache already holds the window, MLC's rule), StartGenerate on D. Returns the
    tokens, D's PrepRecv answer and P's RemoteSend answer (None when skipped)."""
    p_channel, p_stub = engine_stub(prefill_address)
    d_channel, d_stub = engine_stub(decode_address)
    async with p_channel, d_channel:
        prep = await d_stub.PrepRecv(
            engine_pb2.PrepRecvRequest(
                request_id=request_id, token_ids=tokens, end=end, sampling=greedy()
            )
        )
        sent = None
        if prep.prefix_matched_length < prep.end:
            await introduce(p_stub, decode_address)
            sent = await p_stub.RemoteSend(
                engine_pb2.RemoteSendRequest(
                    request_id=request_id,
                    token_ids=tokens,
                    begin=prep.prefix_matched_length,
                    end=prep.end,
                    kv_addr_info=prep.kv_addr_info,
                    sampling=greedy(),
                )
            )
        ids = await generate(d_stub, request_id, tokens, begin=prep.end)
    return ids, prep, sent


async def free_pages(stub: engine_pb2_grpc.EngineAsyncStub) -> int:
    status = await stub.GetStatus(engine_pb2.GetStatusRequest())
    return int(status.num_free_kv_pages)


async def wait_for_free_pages(
    stub: engine_pb2_grpc.EngineAsyncStub, expected: int, within_s: float = 1.0
) -> int:
    """Free pages once they equal `expected`, or the last value seen after `within_s`."""
    deadline = time.monotonic() + within_s
    seen = await free_pages(stub)
    while seen != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        seen = await free_pages(stub)
    return seen


async def logged_path(shim: ShimProcess, request_id: str) -> str:
    """The path= (nixl, shm, grpc) a sender logged for `request_id`'s RemoteSend ("" if none)."""
    for _ in range(100):  # the line reaches the file right after the call returns
        for line in shim.log_text().splitlines():
            if f"RemoteSend {request_id}:" in line:
                return line.rsplit("path=", 1)[1].strip()
        await asyncio.sleep(0.02)
    return ""


# Messages and reads of an Engine.Generate stream (the PD calls on the stream).
def prep_recv_message(request_id: str, tokens: list[int], end: int = -1) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(prep_recv=engine_pb2.PrepRecvRequest(
        request_id=request_id, token_ids=tokens, end=end, sampling=greedy()))


def remote_send_message(request_id: str, tokens: list[int], prep: engine_pb2.PrepRecvResponse,
                        kv_addr_info: bytes | None = None) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(remote_send=engine_pb2.RemoteSendRequest(
        request_id=request_id, token_ids=tokens, begin=prep.prefix_matched_length, end=prep.end,
        kv_addr_info=prep.kv_addr_info if kv_addr_info is None else kv_addr_info,
        sampling=greedy()))


def start_after_kv_message(request_id: str, tokens: list[int], begin: int) -> engine_pb2.EngineGenerateRequest:
    """A start that waits for its reservation's KV (StartGenerateRequest.after_kv_transfer)."""
    return engine_pb2.EngineGenerateRequest(start=engine_pb2.StartGenerateRequest(
        request_id=request_id, token_ids=tokens, begin=begin, sampling=greedy(), after_kv_transfer=True))


async def reserve_on_stream(call, request_id: str, tokens: list[int]) -> engine_pb2.PrepRecvResponse:
    """PrepRecv made on the stream; its answer, which must not be an error."""
    await call.write(prep_recv_message(request_id, tokens))
    output = await next_output(call, request_id)
    assert output.HasField("prep_recv"), output
    return output.prep_recv


async def next_output(call, request_id: str, timeout_s: float = 60.0) -> engine_pb2.GenerateOutput:
    """The next output of `request_id` on the stream (outputs of other ids are skipped)."""
    async def read() -> engine_pb2.GenerateOutput:
        while True:
            message = await call.read()
            assert message is not aio.EOF, "the stream ended early"
            for output in message.outputs:
                if output.request_id == request_id:
                    return output

    return await asyncio.wait_for(read(), timeout_s)


async def streamed_tokens(call, request_id: str) -> list[int]:
    """Every token of `request_id`'s generation on the stream, until its last output; it
    must not fail."""
    ids: list[int] = []
    while True:
        output = await next_output(call, request_id)
        assert not output.HasField("error"), output.error
        for choice in output.choices:
            ids.extend(choice.token_ids)
        if output.HasField("usage"):
            return ids


# The receiver's side of a staged push, with the test as the sender.
async def reserve(stub: engine_pb2_grpc.EngineAsyncStub, request_id: str,
                  tokens: list[int]) -> tuple[int, dict]:
    """PrepRecv for the whole prompt: (its end, the decoded kv_addr_info)."""
    prep = await stub.PrepRecv(
        engine_pb2.PrepRecvRequest(
            request_id=request_id, token_ids=tokens, end=-1, sampling=greedy()
        )
    )
    return prep.end, json.loads(prep.kv_addr_info)


def stage_ones(info: dict, num_tokens: int) -> None:
    """Write KV of ones for the window's first `num_tokens` into the offered stage, the way a
    sender would (through the shim's own SegmentMaps and staged_chunk)."""
    host = host_identity()
    assert host is not None
    maps = SegmentMaps(host)
    layout = KVLayout(**info["layout"])
    stage = maps.open(ShmOffer.from_json(info["shm"]), num_tokens * bytes_per_token(layout))
    assert stage is not None
    staged_chunk(stage, info["begin"], info["begin"], num_tokens, layout).fill_(1.0)
    maps.close()
