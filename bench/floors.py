"""The floors the control plane is measured against, as servers of their own:

- `python -m bench.floors echo --port 0`: a trivial grpc.aio unary servicer (bytes in, the same
  bytes out), built with microserving.transport like every real hop; its round trip is the
  cost of one gRPC call on this machine.
- `python -m bench.floors sse --port 0`: a bare FastAPI endpoint at /v1/completions that
  streams max_tokens OpenAI chunks as fast as it can; the HTTP/SSE layer with nothing behind.

Each prints `bench floor listening on HOST:PORT`. Also holds the echo client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from grpc import aio

from microserving.transport import TransportSettings, add_port, create_channel, create_server

ECHO_METHOD = "/bench.Echo/Echo"


async def _echo(request: bytes, context: aio.ServicerContext) -> bytes:
    return request


async def serve_echo(host: str, port: int) -> None:
    settings = TransportSettings()
    server = create_server(settings)
    handler = grpc.unary_unary_rpc_method_handler(_echo)  # bytes in and out: no serializers
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),)
    )
    bound = add_port(server, f"{host}:{port}", settings)
    await server.start()
    print(f"bench floor listening on {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(1)


async def echo_round_trips_s(
    address: str, concurrency: int, calls_per_worker: int, payload: bytes = b"x" * 64
) -> list[float]:
    """Round-trip times of sequential echo calls from `concurrency` workers on one channel."""
    async with create_channel(address, TransportSettings()) as channel:
        echo = channel.unary_unary(
            ECHO_METHOD, request_serializer=None, response_deserializer=None
        )
        await echo(payload)  # connect first
        times: list[float] = []

        async def worker() -> None:
            for _ in range(calls_per_worker):
                start = time.perf_counter()
                await echo(payload)
                times.append(time.perf_counter() - start)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return times


def sse_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "floor", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        return StreamingResponse(_chunks(int(body.get("max_tokens") or 16)),
                                 media_type="text/event-stream")

    return app


async def _chunks(num_tokens: int) -> AsyncIterator[bytes]:
    for i in range(num_tokens):
        yield _sse({"object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]})
    usage = {"prompt_tokens": 0, "completion_tokens": num_tokens, "total_tokens": num_tokens}
    yield _sse({"object": "text_completion", "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


def _sse(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def serve_sse(host: str, port: int) -> None:
    import socket

    import uvicorn

    sock = socket.create_server((host, port), backlog=2048)
    # Accepted sockets inherit this. asyncio sets TCP_NODELAY itself only on sockets whose
    # proto is IPPROTO_TCP, and create_server's is 0: without it Nagle + delayed ACK hold
    # the first SSE chunk of every reused connection for ~40 ms.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(sse_app(), log_level="warning", access_log=False))
    print(f"bench floor listening on {host}:{bound}", flush=True)
    server.run(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.floors", allow_abbrev=False)
    parser.add_argument("kind", choices=("echo", "sse"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    if args.kind == "echo":
        asyncio.run(serve_echo(args.host, args.port))
    else:
        serve_sse(args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
