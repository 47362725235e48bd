"""What a gRPC call and a stream message cost in grpc.aio (CPU from /proc): 32 concurrent
callers make 6,000 empty unary calls (Router.ListModels), then 6,000 one-message exchanges
on one open bidirectional stream (Router.GenerateBatched), against a servicer that answers
at once. Run from the repository root:
    python grpc_call_cost.py server &  python grpc_call_cost.py client $!"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator

from grpc import aio

from microserving.v1 import router_pb2, router_pb2_grpc

NUM_CALLS = 6000
CONCURRENCY = 32
ADDRESS = "127.0.0.1:50998"


class Answering(router_pb2_grpc.RouterServicer):
    async def ListModels(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        return router_pb2.ListModelsResponse()

    async def GenerateBatched(self, requests, context) -> AsyncIterator[router_pb2.GenerateBatchedResponse]:  # type: ignore[no-untyped-def]  # noqa: N802
        async for _ in requests:
            yield router_pb2.GenerateBatchedResponse()


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def serve() -> None:
    server = aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(Answering(), server)
    server.add_insecure_port(ADDRESS)
    await server.start()
    await server.wait_for_termination()


async def measure(server_pid: int) -> None:
    channel = aio.insecure_channel(ADDRESS)
    stub = router_pb2_grpc.RouterStub(channel)
    await stub.ListModels(router_pb2.ListModelsRequest())

    async def unary_caller() -> None:
        for _ in range(NUM_CALLS // CONCURRENCY):
            await stub.ListModels(router_pb2.ListModelsRequest())

    def report(what: str, before: tuple[float, float, float]) -> None:
        server_s, client_s, wall_s = cpu_s(server_pid), cpu_s(os.getpid()), time.perf_counter()
        print(f"{what} x{CONCURRENCY}: client {1e6 * (client_s - before[1]) / NUM_CALLS:.0f} us, "
              f"server {1e6 * (server_s - before[0]) / NUM_CALLS:.0f} us of CPU each, "
              f"{NUM_CALLS / (wall_s - before[2]):.0f}/s")

    before = (cpu_s(server_pid), cpu_s(os.getpid()), time.perf_counter())
    await asyncio.gather(*(unary_caller() for _ in range(CONCURRENCY)))
    report("unary call", before)

    call = stub.GenerateBatched()
    lock = asyncio.Lock()
    waiting: list[asyncio.Future[None]] = []

    async def reader() -> None:
        while True:
            await call.read()
            waiting.pop(0).set_result(None)

    async def stream_caller() -> None:
        for _ in range(NUM_CALLS // CONCURRENCY):
            answered = asyncio.get_running_loop().create_future()
            async with lock:  # one write in flight per call
                waiting.append(answered)
                await call.write(router_pb2.GenerateBatchedRequest())
            await answered

    reading = asyncio.ensure_future(reader())
    before = (cpu_s(server_pid), cpu_s(os.getpid()), time.perf_counter())
    await asyncio.gather(*(stream_caller() for _ in range(CONCURRENCY)))
    report("stream exchange", before)
    reading.cancel()
    call.cancel()
    await channel.close()


if __name__ == "__main__":
    asyncio.run(serve() if sys.argv[1] == "server" else measure(int(sys.argv[2])))
