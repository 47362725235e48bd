"""`serve(...)` runs the MLC tutorial's CustomRouter as MLC's launcher does: one shim per
endpoint, the router on a gRPC port of its own and the OpenAI gateway on router_port. It
prints one ready line only once every engine answers health, so the first request after it
succeeds; an OpenAI completion gives the tokens one engine gives alone, also when the same
prompt comes again (the tutorial remote_sends from 0, which fits only because serve() starts
the engines without a prefix cache for enable_prefix_cache=False, as MLC's serve does);
Ctrl-C stops it quietly, and an engine that cannot start is named."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from router_stack import REPO, engine_alone, greedy

from microserving.stack.process import free_ports
from microserving.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e

_SCRIPT = """
import sys
sys.path.insert(0, {examples!r})
from custom_router import CustomRouter
from router import serve
serve(model="tiny", model_lib=None, router_host="127.0.0.1", router_port={port},
      endpoint_hosts=["127.0.0.1", "127.0.0.1"], endpoint_ports=[{p0}, {p1}],
      endpoint_num_gpus=[1, 1], enable_prefix_cache=False, router_type=CustomRouter,
      startup_timeout_s=240)
"""


def _launch(port: int, p0: int, p1: int) -> subprocess.Popen[str]:
    script = _SCRIPT.format(examples=str(REPO / "examples"), port=port, p0=p0, p1=p1)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _stop(process: subprocess.Popen[str]) -> tuple[str, str]:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)  # what Ctrl-C sends
    try:
        out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
    return out, err


async def test_serve_runs_the_tutorial_router_behind_the_gateway() -> None:
    port, p0, p1 = free_ports(3)
    process = _launch(port, p0, p1)
    prompt = "Serve me the tutorial, then serve it to me again."
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        assert process.stdout is not None
        ready = process.stdout.readline()  # blocks until serve() says it serves
        # Nothing (the process ended): say why, from its stderr.
        why = process.stderr.read()[-3000:] if not ready and process.stderr is not None else ""
        assert ready.startswith(f"microserving serve: ready at http://127.0.0.1:{port}/v1"), (ready, why)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        reply = httpx.post(url, json=body, timeout=60)  # the first request, not retried
        again = httpx.post(url, json=body, timeout=60)
        want = await engine_alone(f"127.0.0.1:{p1}", Tokenizer.from_model("tiny").encode(prompt),
                                  greedy(8), "serve-alone")
    finally:
        out, err = _stop(process)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == len(want)
    assert reply.json()["choices"][0]["text"] == Tokenizer.from_model("tiny").decode(want)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == reply.json()["choices"][0]["text"]
    assert process.returncode == 0 and out == ""  # the ready line was the only one
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_serve_names_an_engine_that_cannot_start() -> None:
    port, p0 = free_ports(2)
    with socket.socket() as taken:  # engine 1's port is held: its shim cannot bind
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        p1 = taken.getsockname()[1]
        process = _launch(port, p0, p1)
        try:
            out, err = process.communicate(timeout=240)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 1
    assert f"the engine on 127.0.0.1:{p1} exited with code" in err
    assert "Traceback (most recent call last)" not in err.split("microserving serve:")[-1]
