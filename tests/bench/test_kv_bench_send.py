"""kv_bench end to end on the CPU: two shim processes, P's RemoteSends made as the router makes
them (a message each on P's Engine.Generate stream) or as unary calls; kv_bench itself checks
that P logged every send on the path it was offered. And run as a program, its gRPC calls use
the stack's I/O stack: bench/grpc_first.py must load before gRPC does."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from bench import kv_bench

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("send_via", kv_bench.SEND_VIAS)
def test_sends_on_the_stream_or_unary_move_the_window(send_via: str) -> None:
    # 2,032 tokens of the tiny model: 4 MB a send, so kv_bench's ~1 GiB makes ~260 of them.
    rows = asyncio.run(kv_bench.run("tiny", [2032], num_pages=400, paths=("shm",),
                                    send_via=send_via))
    (row,) = rows
    assert row["send_via"] == send_via
    assert row["tokens"] == 2032 and row["kv_mib"] == pytest.approx(4.0, rel=0.01)
    assert isinstance(row["shm_runs"], int) and row["shm_runs"] >= 5
    assert isinstance(row["shm_gbps"], float) and row["shm_gbps"] > 0


def _grpc_experiments_after(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return out.strip().splitlines()[-1]


def test_kv_bench_as_a_program_sets_the_stack_grpc_io_before_grpc_loads() -> None:
    # as `python -m bench.kv_bench` runs it: the module is __main__ while its imports run
    ran = ("import os, runpy, sys\n"
           "sys.argv = ['kv_bench', '--help']\n"
           "try:\n"
           "    runpy.run_module('bench.kv_bench', run_name='__main__', alter_sys=True)\n"
           "except SystemExit:\n"
           "    pass\n"
           "print('grpc_io', os.environ.get('GRPC_EXPERIMENTS'))")
    assert _grpc_experiments_after(ran) == "grpc_io -event_engine_client,-event_engine_listener"
    # imported as a library (a test's process): the environment is left alone
    imported = "import os, bench.kv_bench; print('grpc_io', os.environ.get('GRPC_EXPERIMENTS'))"
    assert _grpc_experiments_after(imported) == "grpc_io None"
