"""Gateway benchmark: what the HTTP layer adds over Router.Generate, beside a bare FastAPI SSE
endpoint as the floor, at several numbers of concurrent streams.

    python -m bench.gateway_bench --concurrency 64 256 --tokens 64

Three processes are started from their entry points: a synthetic Router (answers every request
with `--tokens` one-token deltas as fast as it can, so engine time is out of the picture), the
real gateway (`microserving gateway`) in front of it, and a bare FastAPI app streaming the same
number of SSE events. For each concurrency the bench opens that many streams at once against
(a) Router.Generate over one gRPC channel, (b) the gateway's /v1/completions, (c) the bare SSE
endpoint, and reports p50/p99 time to first token and the aggregate relay rate (tokens/s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass

import aiohttp
import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from grpc import aio

from microserving.stack.process import free_port
from microserving.transport import TransportSettings, add_port, create_channel, create_server
from microserving.v1 import common_pb2, router_pb2, router_pb2_grpc


class SyntheticRouter(router_pb2_grpc.RouterServicer):
    """Every request: max_tokens deltas of one token each, a finish, then done. Like the real
    router, the requests of one stream run concurrently (a client may multiplex many on one
    call, as the gateway does): each request's producer yields to the others after every
    token, as an engine step would, and a bounded queue holds them back while the stream's
    writer is busy."""

    async def Generate(self, request_iterator: AsyncIterator[router_pb2.GenerateRequest],
                       context: aio.ServicerContext) -> AsyncIterator[router_pb2.GenerateResponse]:
        outbox: asyncio.Queue[router_pb2.GenerateResponse | None] = asyncio.Queue(maxsize=256)
        producers: set[asyncio.Task[None]] = set()

        async def produce(request: router_pb2.NewRequest) -> None:
            rid, count = request.request_id, request.sampling.max_tokens
            for position in range(count):
                reason = common_pb2.FINISH_REASON_LENGTH if position == count - 1 \
                    else common_pb2.FINISH_REASON_UNSPECIFIED
                await outbox.put(router_pb2.GenerateResponse(request_id=rid, delta=common_pb2.ChoiceDelta(
                    index=0, token_ids=[120], text="x", finish_reason=reason)))
                await asyncio.sleep(0)
            await outbox.put(router_pb2.GenerateResponse(request_id=rid, finish=router_pb2.ChoiceFinish(
                index=0, reason=common_pb2.FINISH_REASON_LENGTH)))
            usage = common_pb2.Usage(prompt_tokens=1, completion_tokens=count,
                                     total_tokens=count + 1)
            await outbox.put(router_pb2.GenerateResponse(request_id=rid, done=router_pb2.RequestDone(
                usage=usage)))

        async def read() -> None:
            async for message in request_iterator:
                if message.WhichOneof("action") == "generate":
                    task = asyncio.get_running_loop().create_task(produce(message.generate))
                    producers.add(task)
                    task.add_done_callback(producers.discard)
            await asyncio.gather(*producers)
            await outbox.put(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while (item := await outbox.get()) is not None:
                yield item
        finally:
            reader.cancel()
            for task in list(producers):
                task.cancel()

    async def GenerateBatched(
        self, request_iterator: AsyncIterator[router_pb2.GenerateBatchedRequest],
        context: aio.ServicerContext,
    ) -> AsyncIterator[router_pb2.GenerateBatchedResponse]:
        """Generate's events, everything queued at each write in one message (as the router)."""
        batch = router_pb2.GenerateBatchedResponse()
        # The two request messages carry the same actions under the same field numbers.
        events = self.Generate(request_iterator, context).__aiter__()  # type: ignore[arg-type]
        pending: asyncio.Task[router_pb2.GenerateResponse] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(events.__anext__())
                if not batch.responses or pending.done():
                    try:
                        batch.responses.append(await pending)
                    except StopAsyncIteration:
                        break
                    pending = None
                    continue
                yield batch
                batch = router_pb2.GenerateBatchedResponse()
            if batch.responses:
                yield batch
        finally:
            if pending is not None:
                pending.cancel()

    async def ListModels(self, request: router_pb2.ListModelsRequest,
                         context: aio.ServicerContext) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelInfo(id="synthetic")])

    async def GetStatus(self, request: router_pb2.RouterGetStatusRequest,
                        context: aio.ServicerContext) -> router_pb2.RouterGetStatusResponse:
        return router_pb2.RouterGetStatusResponse()

    async def MigrateContext(self, request: router_pb2.MigrateContextRequest,
                             context: aio.ServicerContext) -> router_pb2.MigrateContextResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "synthetic router")
        raise AssertionError("unreachable")  # abort raises


async def serve_synthetic_router(port: int) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1._async import HealthServicer

    server = create_server(TransportSettings())
    router_pb2_grpc.add_RouterServicer_to_server(SyntheticRouter(), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    add_port(server, f"127.0.0.1:{port}", TransportSettings())
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


def serve_bare_sse(port: int) -> None:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        count = int((await request.json())["max_tokens"])

        async def events() -> AsyncIterator[bytes]:
            for position in range(count):
                chunk = {"id": "bare", "object": "text_completion", "created": 0,
                         "model": "synthetic", "choices": [{
                             "index": 0, "text": "x", "logprobs": None,
                             "finish_reason": "length" if position == count - 1 else None}]}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


@dataclass(frozen=True)
class StreamResult:
    ttft_s: float
    num_tokens: int


@dataclass(frozen=True)
class CellResult:
    target: str
    concurrency: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    relay_tokens_per_s: float
    num_tokens: int


async def grpc_stream(stub: router_pb2_grpc.RouterStub, index: int, tokens: int) -> StreamResult:
    started_s = time.perf_counter()
    call = stub.Generate()
    await call.write(router_pb2.GenerateRequest(generate=router_pb2.NewRequest(
        request_id=f"b{index}", sampling=common_pb2.SamplingParams(max_tokens=tokens))))
    ttft_s, count = 0.0, 0
    while True:
        event = await call.read()
        if event is aio.EOF or event.WhichOneof("event") == "done":
            break
        if event.WhichOneof("event") == "delta":
            ttft_s = ttft_s or time.perf_counter() - started_s
            count += len(event.delta.token_ids)
    call.cancel()
    return StreamResult(ttft_s, count)


async def http_stream(session: aiohttp.ClientSession, url: str, tokens: int) -> StreamResult:
    started_s = time.perf_counter()
    body = {"model": "synthetic", "prompt": "x", "max_tokens": tokens, "stream": True}
    ttft_s, count = 0.0, 0
    async with session.post(url, json=body) as reply:
        reply.raise_for_status()
        async for line in reply.content:
            if line.startswith(b"data: {"):
                ttft_s = ttft_s or time.perf_counter() - started_s
                count += 1
    return StreamResult(ttft_s, count)


async def run_cell(target: str, concurrency: int,
                   one: Callable[[int], Awaitable[StreamResult]]) -> CellResult:
    started_s = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    except Exception as error:
        raise RuntimeError(f"{target} at {concurrency} streams failed: {error!r}") from error
    elapsed_s = time.perf_counter() - started_s
    ttfts = sorted(r.ttft_s for r in results)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
    total = sum(r.num_tokens for r in results)
    return CellResult(target, concurrency, 1000 * statistics.median(ttfts), 1000 * p99,
                      total / elapsed_s, total)


async def wait_http(session: aiohttp.ClientSession, url: str, timeout_s: float = 60) -> None:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        try:
            async with session.get(url) as reply:
                if reply.status < 500:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


async def bench(concurrencies: list[int], tokens: int, repeats: int) -> list[CellResult]:
    router_port, gateway_port, bare_port = free_port(), free_port(), free_port()
    me = [sys.executable, "-m", "bench.gateway_bench"]
    children = [
        subprocess.Popen([*me, "--serve-router", str(router_port)]),
        subprocess.Popen([*me, "--serve-bare-sse", str(bare_port)]),
        subprocess.Popen([sys.executable, "-m", "microserving.cli", "gateway", "--router",
                          f"127.0.0.1:{router_port}", "--port", str(gateway_port),
                          "--log-level", "warning"], stdout=subprocess.DEVNULL),
    ]
    results: list[CellResult] = []
    try:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # no stale keep-alives
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await wait_http(session, f"http://127.0.0.1:{gateway_port}/health")
            await wait_http(session, f"http://127.0.0.1:{bare_port}/docs")
            channel = create_channel(f"127.0.0.1:{router_port}", TransportSettings())
            stub = router_pb2_grpc.RouterStub(channel)
            gateway_url = f"http://127.0.0.1:{gateway_port}/v1/completions"
            bare_url = f"http://127.0.0.1:{bare_port}/v1/completions"
            targets: dict[str, Callable[[int], Awaitable[StreamResult]]] = {
                "router-grpc": lambda i: grpc_stream(stub, i, tokens),
                "gateway-http": lambda i: http_stream(session, gateway_url, tokens),
                "bare-fastapi-sse": lambda i: http_stream(session, bare_url, tokens),
            }
            for name, one in targets.items():  # warm every path once
                await run_cell(name, 4, one)
            for concurrency in concurrencies:
                for _ in range(repeats):
                    for name, one in targets.items():
                        results.append(await run_cell(name, concurrency, one))
            await channel.close()
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(timeout=30)
    return results


def print_table(results: list[CellResult]) -> None:
    print(f"{'target':<18}{'streams':>8}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'tokens/s':>11}")
    for r in results:
        print(f"{r.target:<18}{r.concurrency:>8}{r.ttft_p50_ms:>13.1f}{r.ttft_p99_ms:>13.1f}"
              f"{r.relay_tokens_per_s:>11.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_bench", description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--serve-router", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-bare-sse", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_router:
        asyncio.run(serve_synthetic_router(args.serve_router))
        return 0
    if args.serve_bare_sse:
        serve_bare_sse(args.serve_bare_sse)
        return 0
    results = asyncio.run(bench(args.concurrency, args.tokens, args.repeats))
    print_table(results)
    if args.json:
        with open(args.json, "w") as out:
            json.dump([asdict(r) for r in results], out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
