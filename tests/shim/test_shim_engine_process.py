"""Shims whose engine core runs in a process of its own (`--engine-process on`, the default on
CUDA): PD between them over every KV path (NIXL and the shared-memory stage read and write the
pool the core shares with its shim; gRPC chunks cross the pipe) matches a shim whose core
runs in a thread, pages come back on both sides, and a core that dies ends the calls in
flight with UNAVAILABLE and the shim with it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from shim_helpers import (
    ShimProcess,
    engine_stub,
    free_pages,
    generate,
    generate_alone,
    greedy,
    logged_path,
    pd_flow,
    start_shim,
    wait_for_free_pages,
)

from engine_shim.backends.embedded.kv_plane.nixl import load_nixl
from microserving.v1 import engine_pb2

pytestmark = pytest.mark.e2e

NIXL, _ = load_nixl()
_ENGINE_TID = re.compile(r"engine thread native id (\d+)")
# Sender transport setting -> the path its RemoteSend takes to a receiver that offers all.
# (A push through the receiver's stage goes on its PushKVStream: shm-stream.)
_PATHS = {"auto": "nixl" if NIXL is not None else "shm-stream", "shm": "shm-stream", "grpc": "grpc"}


@pytest.fixture(scope="module")
def process_shims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ShimProcess]]:
    """A decode shim and one prefill shim per sender transport, each core in its own process."""
    tmp = tmp_path_factory.mktemp("process-shims")
    specs = {"decode": ("--role", "decode")} | {
        f"prefill-{t}": ("--role", "prefill", "--kv-transport", t) for t in _PATHS
    }
    with ThreadPoolExecutor(len(specs)) as pool:
        started = {
            name: pool.submit(start_shim, tmp, name, "--engine-process", "on", *args)
            for name, args in specs.items()
        }
        shims = {name: future.result() for name, future in started.items()}
    yield shims
    for shim in shims.values():
        shim.stop()


def _engine_pid(shim: ShimProcess) -> int:
    match = _ENGINE_TID.search(shim.log_text())
    assert match, "the shim did not log its engine loop's thread id"
    return int(match.group(1))


def test_the_core_runs_in_a_child_process_of_the_shim(process_shims) -> None:
    for shim in process_shims.values():
        pid = _engine_pid(shim)  # the core process's main thread: its pid
        assert pid != shim.process.pid
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        assert parent == shim.process.pid


@pytest.mark.parametrize("transport", list(_PATHS))
async def test_pd_between_process_cores_matches_a_thread_core(
    process_shims, decode_shim, transport: str
) -> None:
    prefill, decode = process_shims[f"prefill-{transport}"], process_shims["decode"]
    tokens = [10 + (i * 11 + len(transport)) % 200 for i in range(150)]
    expected = await generate_alone(decode_shim.address, f"alone-{transport}", tokens)  # a thread core
    request_id = f"pd-{transport}"
    ids, prep, sent = await pd_flow(prefill.address, decode.address, request_id, tokens)
    assert await logged_path(prefill, request_id) == _PATHS[transport]
    assert sent is not None and sent.num_tokens_sent == prep.end - prep.prefix_matched_length
    assert ids == expected and len(ids) == 16
    for shim in (prefill, decode):
        channel, stub = engine_stub(shim.address)
        async with channel:
            status = await stub.GetStatus(engine_pb2.GetStatusRequest())
            total = status.num_total_kv_pages
            assert await wait_for_free_pages(stub, total, within_s=10.0) == total


async def test_a_dead_core_fails_the_calls_in_flight_and_the_shim_exits(tmp_path) -> None:
    shim = start_shim(tmp_path, "doomed", "--engine-process", "on")
    try:
        channel, stub = engine_stub(shim.address)
        async with channel:
            assert await free_pages(stub) > 0
            long = greedy(max_tokens=1000)
            call = asyncio.ensure_future(generate(stub, "victim", list(range(10, 40)), sampling=long))
            await asyncio.sleep(0.5)  # let it start streaming
            assert not call.done()
            os.kill(_engine_pid(shim), signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await asyncio.wait_for(call, timeout=60)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "engine process exited" in (raised.value.details() or "")
        deadline = time.monotonic() + 60
        while shim.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert shim.process.returncode == 1
        assert "the engine is gone" in shim.log_text()
    finally:
        shim.stop()
