"""A test double for "an OpenAI-compatible server" with known timing: it waits ttft_s before
the first token, then emits one token per chunk every gap_s, and can answer chosen requests
with an HTTP error. It counts requests in flight, so tests can check the load shape."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL_ID = "timed-model"


@dataclass
class Timing:
    ttft_s: float = 0.05
    gap_s: float = 0.01
    # Status of the i-th request (cycled); 200 streams normally.
    status_cycle: Sequence[int] = (200,)
    arrivals_s: list[float] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0
    num_requests: int = 0


def _chunk(kind: str, text: str | None, usage: dict[str, int] | None = None) -> bytes:
    if kind == "chat":
        choices = [] if text is None else [{"index": 0, "delta": {"content": text}}]
        body: dict[str, Any] = {"object": "chat.completion.chunk", "choices": choices}
    else:
        choices = [] if text is None else [{"index": 0, "text": text}]
        body = {"object": "text_completion", "choices": choices}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


def make_app(timing: Timing) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    async def generate(request: Request, kind: str) -> Any:
        body = await request.json()
        index = timing.num_requests
        timing.num_requests += 1
        timing.arrivals_s.append(time.perf_counter())
        status = timing.status_cycle[index % len(timing.status_cycle)]
        if status != 200:
            return JSONResponse({"error": {"message": "injected", "type": "x"}}, status_code=status)
        prompt = body.get("prompt") or body.get("messages")
        num_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        return StreamingResponse(
            _tokens(timing, kind, int(body["max_tokens"]), num_prompt),
            media_type="text/event-stream",
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await generate(request, "chat")

    return app


async def _tokens(timing: Timing, kind: str, num_tokens: int, num_prompt: int) -> AsyncIterator[bytes]:
    timing.in_flight += 1
    timing.peak_in_flight = max(timing.peak_in_flight, timing.in_flight)
    try:
        await asyncio.sleep(timing.ttft_s)
        for i in range(num_tokens):
            if i:
                await asyncio.sleep(timing.gap_s)
            yield _chunk(kind, f"t{i} ")
        usage = {"prompt_tokens": num_prompt, "completion_tokens": num_tokens,
                 "total_tokens": num_prompt + num_tokens}
        yield _chunk(kind, None, usage)
        yield b"data: [DONE]\n\n"
    finally:
        timing.in_flight -= 1


@contextmanager
def serve_timed(timing: Timing) -> Iterator[str]:
    """Serve on 127.0.0.1, port 0, in a thread of its own; yields the base URL (…/v1)."""
    server = uvicorn.Server(
        uvicorn.Config(make_app(timing), host="127.0.0.1", port=0, log_level="warning",
                       lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("timed server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
