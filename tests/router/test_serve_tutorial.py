"""`serve(...)` runs the MLC tutorial's CustomRouter as MLC's launcher does: one shim per
endpoint, the router on a gRPC port of its own and the OpenAI gateway on router_port; an
OpenAI completion through it gives the tokens one engine gives alone, also when the same
prompt comes again (the tutorial remote_sends from 0, which fits only because serve() starts
the engines without a prefix cache for enable_prefix_cache=False, as MLC's serve does)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from router_stack import REPO, engine_alone, greedy

from microserving.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e

_SCRIPT = """
import sys
sys.path.insert(0, {examples!r})
from custom_router import CustomRouter
from router import serve
serve(model="tiny", model_lib=None, router_host="127.0.0.1", router_port={port},
      endpoint_hosts=["127.0.0.1", "127.0.0.1"], endpoint_ports=[{p0}, {p1}],
      endpoint_num_gpus=[1, 1], enable_prefix_cache=False, router_type=CustomRouter)
"""


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for sock in sockets:
        sock.close()
    return ports


def _wait_completion(url: str, body: dict, timeout_s: float = 150.0) -> dict:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            reply = httpx.post(url, json=body, timeout=30)
            if reply.status_code == 200:
                return reply.json()
            last = reply.text
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(1.0)
    raise AssertionError(f"no completion from {url}: {last}")


async def test_serve_runs_the_tutorial_router_behind_the_gateway() -> None:
    port, p0, p1 = _free_ports(3)
    script = _SCRIPT.format(examples=str(REPO / "examples"), port=port, p0=p0, p1=p1)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    prompt = "Serve me the tutorial, then serve it to me again."
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        reply = _wait_completion(url, body)
        again = httpx.post(url, json=body, timeout=60)
        want = await engine_alone(f"127.0.0.1:{p1}", Tokenizer.from_model("tiny").encode(prompt), greedy(8), "serve-alone")
    finally:
        os.killpg(process.pid, 15)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
    assert reply["usage"]["completion_tokens"] == len(want)
    assert reply["choices"][0]["text"] == Tokenizer.from_model("tiny").decode(want)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == reply["choices"][0]["text"]
