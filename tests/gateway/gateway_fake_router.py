"""A TEST DOUBLE of the Router service, so the gateway (the component under test) can be driven
over real gRPC before / without the real router.

Its "model" `fake` answers each prompt with the prompt's characters reversed, one character per
token (a seeded shuffle when temperature > 0). Magic prompts trigger errors and slow streams.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from microserving.transport import TransportSettings, add_port, create_server
from microserving.v1 import common_pb2, router_pb2, router_pb2_grpc

MODEL_ID = "fake"
MAX_CONTEXT = 64
ERROR_PROMPTS = {"!overloaded": 8, "!unavailable": 14, "!invalid": 3, "!internal": 13}


def output_text(prompt: str, sampling: common_pb2.SamplingParams, choice: int) -> str:
    text = prompt[::-1] or "empty"
    if sampling.HasField("temperature") and sampling.temperature > 0:
        seed = sampling.seed if sampling.HasField("seed") else random.randrange(1 << 30)
        chars = list(text)
        random.Random(seed * 31 + choice).shuffle(chars)
        text = "".join(chars)
    limit = sampling.max_tokens if sampling.HasField("max_tokens") else len(text)
    return text[:limit]


class FakeRouter(router_pb2_grpc.RouterServicer):
    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.active: set[str] = set()
        self.seen: list[router_pb2.NewRequest] = []
        self.token_delay_s = 0.0
        self.num_generate_calls = 0  # Router.Generate calls opened
        self.cancel_messages: list[str] = []  # ids of the `cancel` messages received

    async def Generate(self, request_iterator: AsyncIterator[router_pb2.GenerateRequest],
                       context: aio.ServicerContext) -> AsyncIterator[router_pb2.GenerateResponse]:
        queue: asyncio.Queue[router_pb2.GenerateResponse | None] = asyncio.Queue()
        tasks: list[asyncio.Task[None]] = []
        by_id: dict[str, asyncio.Task[None]] = {}
        self.num_generate_calls += 1

        async def read() -> None:
            async for message in request_iterator:
                action = message.WhichOneof("action")
                if action == "generate":
                    task = asyncio.ensure_future(self._run(message.generate, queue))
                    tasks.append(task)
                    by_id[message.generate.request_id] = task
                elif action == "cancel":  # as the real router: cancel one request of the stream
                    self.cancel_messages.append(message.cancel.request_id)
                    cancelled = by_id.pop(message.cancel.request_id, None)
                    if cancelled is not None:
                        cancelled.cancel()

        reader = asyncio.ensure_future(read())
        try:
            while True:
                event = await queue.get()
                if event is not None:
                    yield event
        finally:
            reader.cancel()
            for task in tasks:
                task.cancel()

    async def GenerateBatched(
        self, request_iterator: AsyncIterator[router_pb2.GenerateRequest], context: aio.ServicerContext,
    ) -> AsyncIterator[router_pb2.GenerateBatchedResponse]:
        """Generate's events, each in a batch of its own (a valid batching: the contract
        leaves the grouping to the router)."""
        async for event in self.Generate(request_iterator, context):
            yield router_pb2.GenerateBatchedResponse(responses=[event])

    async def _run(self, request: router_pb2.NewRequest,
                   queue: asyncio.Queue[router_pb2.GenerateResponse | None]) -> None:
        rid = request.request_id
        self.seen.append(request)
        self.active.add(rid)
        try:
            await self._generate(request, lambda **kw: queue.put_nowait(
                router_pb2.GenerateResponse(request_id=rid, **kw)))
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.active.discard(rid)

    async def _generate(self, request: router_pb2.NewRequest, send) -> None:  # type: ignore[no-untyped-def]
        if request.model not in ("", MODEL_ID):
            send(error=router_pb2.RequestError(code=5, message=f"model {request.model!r} not found",
                                               param="model"))
            return
        kind = request.WhichOneof("input")
        prompt = request.text if kind == "text" else (
            "".join(chr(t) for t in request.token_ids.ids) if kind == "token_ids"
            else "".join(m.content for m in request.chat.messages))
        if prompt in ERROR_PROMPTS:
            send(error=router_pb2.RequestError(code=ERROR_PROMPTS[prompt], message="as asked",
                                               param="prompt"))
            return
        if len(prompt) > MAX_CONTEXT:
            send(error=router_pb2.RequestError(code=11, param="prompt",
                                               message="prompt exceeds the context length"))
            return
        if request.echo:
            send(prompt=router_pb2.PromptInfo(token_ids=[ord(c) for c in prompt], text=prompt))
        sampling = request.sampling
        n = sampling.n if sampling.HasField("n") else 1
        completion_tokens = 0
        for choice in range(n):
            text = output_text(prompt, sampling, choice)
            cut = min([text.find(s) for s in sampling.stop if s in text], default=-1)
            reason = common_pb2.FINISH_REASON_STOP if cut >= 0 or not sampling.HasField(
                "max_tokens") or len(text) < sampling.max_tokens else common_pb2.FINISH_REASON_LENGTH
            text = text[:cut] if cut >= 0 else text
            for position, char in enumerate(text):
                if prompt.startswith("slow"):
                    await asyncio.sleep(0.05)
                last = position == len(text) - 1
                logprobs = [common_pb2.TokenLogprob(
                    token_id=ord(char), token=char, logprob=-0.5,
                    top_logprobs=[common_pb2.TopLogprob(token=char, logprob=-0.5)
                                  for _ in range(sampling.top_logprobs)])] if sampling.logprobs else []
                send(delta=common_pb2.ChoiceDelta(index=choice, token_ids=[ord(char)], text=char,
                                                  logprobs=logprobs,
                                                  finish_reason=reason if last else 0))
                completion_tokens += 1
                await asyncio.sleep(0)
            send(finish=router_pb2.ChoiceFinish(index=choice, reason=reason))
        usage = common_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=completion_tokens,
                                 total_tokens=len(prompt) + completion_tokens)
        send(done=router_pb2.RequestDone(usage=usage, engines=["fake:1"]))

    async def ListModels(self, request: router_pb2.ListModelsRequest,
                         context: aio.ServicerContext) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelInfo(
            id=MODEL_ID, created=1, owned_by="tests", max_context_length=MAX_CONTEXT)])

    async def GetStatus(self, request: router_pb2.RouterGetStatusRequest,
                        context: aio.ServicerContext) -> router_pb2.RouterGetStatusResponse:
        return router_pb2.RouterGetStatusResponse(num_inflight_requests=len(self.active))


class FakeRouterServer:
    """The double on 127.0.0.1:<any port>, with a controllable grpc.health.v1 status."""

    def __init__(self) -> None:
        self.servicer = FakeRouter()
        self._health = HealthServicer()
        self._server: aio.Server | None = None
        self.port = 0

    async def start(self, port: int = 0) -> None:
        self._server = create_server(TransportSettings())
        router_pb2_grpc.add_RouterServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = add_port(self._server, f"127.0.0.1:{port}", TransportSettings())
        await self.set_serving(True)
        await self._server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set("", status)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)


