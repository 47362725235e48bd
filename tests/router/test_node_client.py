"""A client in another language: examples/node/client.js (grpc-js + proto-loader) streams a
completion over Router.Generate against a real router + shim stack and cancels a second one
mid-stream."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import pytest
from router_stack import REPO, engine_alone, greedy, router_settings, running_router

from microserving.tokenizer import Tokenizer
from router.router import Router

pytestmark = pytest.mark.e2e
NODE_DIR = REPO / "examples" / "node"


def _install() -> None:
    if (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        return
    command = ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"]
    subprocess.run(command, cwd=NODE_DIR, check=True, timeout=300)


@pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None, reason="needs node and npm")
async def test_node_client_streams_and_cancels_over_router_generate(shims) -> None:
    await asyncio.to_thread(_install)
    prompt = "Hello from Node.js"
    engines = [f"{shims[0].address}=prefill", f"{shims[1].address}=decode"]
    async with running_router(Router(settings=router_settings(engines, pattern="disagg"))) as (running, _):
        process = await asyncio.create_subprocess_exec(
            "node", "client.js", f"127.0.0.1:{running.port}", prompt, cwd=NODE_DIR,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, stderr.decode()
    results = json.loads(stdout)
    want = await engine_alone(shims[2].address, Tokenizer.from_model("tiny").encode(prompt), greedy(16), "node-alone")
    full, cancelled = results["full"], results["cancelled"]
    assert full["error"] is None and full["token_ids"] == want
    assert full["usage"]["completion_tokens"] == len(want) and len(full["engines"]) == 2
    assert cancelled["finish_reasons"] == ["FINISH_REASON_ABORT"]
    assert 0 < len(cancelled["token_ids"]) < 400
