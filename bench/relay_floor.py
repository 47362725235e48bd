"""The floor of a Python gRPC router: a Router.Generate servicer that does nothing but forward
each request to an engine's StartGenerate (engines taken in turn) and relay the engine's deltas
as they come, then one `done`. No validation, tokenization, engine choice, retries, deadlines
or cleanup. router_bench measures it beside the real router on the same engines: what it adds
is what grpc.aio itself costs for one more hop.

    python -m bench.relay_floor --engine HOST:PORT [--engine HOST:PORT ...]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence

import grpc

from microserving.v1 import engine_pb2, engine_pb2_grpc, router_pb2


class FloorRelay:
    def __init__(self, engines: Sequence[str]) -> None:
        self._stubs = [engine_pb2_grpc.EngineStub(grpc.aio.insecure_channel(a)) for a in engines]
        self._turn = itertools.count()

    async def Generate(
        self, request_iterator: AsyncIterator[router_pb2.GenerateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        async for message in request_iterator:  # one request at a time: enough for the bench
            new = message.generate
            stub = self._stubs[next(self._turn) % len(self._stubs)]
            call = stub.StartGenerate(engine_pb2.StartGenerateRequest(
                request_id=new.request_id, token_ids=new.token_ids.ids, sampling=new.sampling))
            async for reply in call:
                for delta in reply.choices:
                    yield router_pb2.GenerateResponse(request_id=new.request_id, delta=delta)
            yield router_pb2.GenerateResponse(request_id=new.request_id, done=router_pb2.RequestDone())


async def serve(engines: Sequence[str]) -> None:
    server = grpc.aio.server()
    generate = grpc.stream_stream_rpc_method_handler(
        FloorRelay(engines).Generate, request_deserializer=router_pb2.GenerateRequest.FromString,
        response_serializer=router_pb2.GenerateResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("microserving.v1.Router",
                                                                          {"Generate": generate}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"relay floor listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(prog="relay_floor", description=__doc__)
    parser.add_argument("--engine", action="append", required=True, help="HOST:PORT[=ROLE] (role ignored)")
    args = parser.parse_args()
    asyncio.run(serve([e.split("=", 1)[0] for e in args.engine]))


if __name__ == "__main__":
    main()
