"""`microserving mlc-compat`: the embedded engine behind MLC-LLM's HTTP microserving routes.
Binds first (port 0 allowed), prints `microserving mlc-compat listening on HOST:PORT`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys

import uvicorn
from pydantic import ValidationError

from engine_shim.mlc_http.settings import MLCCompatSettings
from microserving.event_loop import loop_runner
from microserving.tokenizer import MODEL_HELP


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="microserving mlc-compat", description=__doc__)
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port; 0 picks a free one")
    parser.add_argument("--device", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", help="float32 | bfloat16 | float16")
    parser.add_argument("--page-size", type=int, help="tokens per KV page")
    parser.add_argument("--num-pages", type=int, help="KV pages in the pool")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--enable-prefix-cache",
        choices=("true", "false"),
        help="true (default, as `mlc_llm serve`) | false: reuse KV of shared prompt prefixes",
    )
    cache.add_argument(
        "--prefix-cache-mode",
        choices=("radix", "disable"),
        help="MLC's spelling of --enable-prefix-cache: radix = true, disable = false",
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="RANK=URL",
        help="where remote_send delivers KV for recv_rank RANK (repeatable)",
    )
    parser.add_argument("--max-num-seqs", type=int, help="running sequences per engine step")
    parser.add_argument(
        "--synthetic",
        action="store_true",
        default=None,
        help="BENCHMARK ONLY: a model-free engine core that emits tokens on a GPU step-time "
        "schedule (engine_shim/backends/synthetic), to measure the HTTP server and what fronts it",
    )
    parser.add_argument("--synthetic-step-ms", help="synthetic core: decode step ms by batch")
    parser.add_argument("--synthetic-prefill-tok-s", type=float, help="synthetic core: prefill rate")
    parser.add_argument("--log-level", help="logging level")
    parser.add_argument("--event-loop", choices=("auto", "asyncio", "uvloop"),
                        help="the server's event loop (default auto: uvloop when installed)")
    return parser


def parse_settings(argv: list[str]) -> MLCCompatSettings:
    args = vars(_parser().parse_args(argv))
    peers: dict[int, str] = {}
    for item in args.pop("peer"):
        rank, sep, url = item.partition("=")
        if not sep or not rank.strip().isdigit() or not url:
            raise SystemExit(f"microserving mlc-compat: --peer wants RANK=URL, got {item!r}")
        peers[int(rank)] = url.rstrip("/")
    enable = args.pop("enable_prefix_cache")
    mode = args.pop("prefix_cache_mode")
    given = {name: value for name, value in args.items() if value is not None}
    if enable is not None or mode is not None:
        given["enable_prefix_cache"] = enable == "true" or mode == "radix"
    if peers:
        given["peers"] = peers
    return MLCCompatSettings(**given)


def bind(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP so asyncio sets TCP_NODELAY on accepted connections (see gateway/cli.py).
    sock = socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


async def serve(settings: MLCCompatSettings) -> None:
    from engine_shim.mlc_http.app import create_app

    sock = bind(settings.host, settings.port)
    config = uvicorn.Config(create_app(settings), log_level=settings.log_level.lower())
    server = uvicorn.Server(config)
    port = sock.getsockname()[1]

    async def announce() -> None:
        while not server.started:  # uvicorn exposes no start-up event
            await asyncio.sleep(0.05)
        print(f"microserving mlc-compat listening on {settings.host}:{port}", flush=True)

    announcer = asyncio.create_task(announce())
    try:
        await server.serve(sockets=[sock])
    finally:
        announcer.cancel()


def main(argv: list[str]) -> int:
    try:
        settings = parse_settings(argv)
    except ValidationError as error:
        print(f"microserving mlc-compat: invalid settings:\n{error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper())
    loop_runner(settings.event_loop)(serve(settings))
    return 0
