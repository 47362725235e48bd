"""POST /v1/chat/completions: router events -> chat.completion responses and chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from gateway.protocol.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
)
from gateway.router_requests import chat_request
from gateway.serving.base import GenerationServing, RouterEvents, usage_model
from gateway.serving.events import DeltaEvent, UsageTotals
from gateway.sse import ChunkTemplate, encode_event
from microserving.v1 import common_pb2, router_pb2


def chat_logprobs(tokens: Sequence[common_pb2.TokenLogprob]) -> list[ChatTokenLogprob]:
    return [
        ChatTokenLogprob(
            token=token.token, logprob=token.logprob, bytes=list(token.token_bytes),
            top_logprobs=[ChatTopLogprob(token=alt.token, logprob=alt.logprob,
                                         bytes=list(alt.token_bytes))
                          for alt in token.top_logprobs])
        for token in tokens
    ]


class ChatServing(GenerationServing[ChatCompletionRequest]):
    id_prefix = "chatcmpl"

    def convert(self, request: ChatCompletionRequest, base_id: str) -> list[router_pb2.NewRequest]:
        return [chat_request(request, base_id)]

    async def complete(self, request: ChatCompletionRequest, response_id: str,
                       events: RouterEvents) -> ChatCompletionResponse:
        texts = [""] * request.n
        reasons: list[str | None] = [None] * request.n
        logprobs: list[list[ChatTokenLogprob]] = [[] for _ in range(request.n)]
        usage = UsageTotals()
        async for batch in events:
            if isinstance(batch, UsageTotals):
                usage = batch
                continue
            for event in batch:
                if isinstance(event, DeltaEvent):
                    texts[event.index] += event.text
                    logprobs[event.index] += chat_logprobs(event.logprobs)
                    reasons[event.index] = event.finish_reason or reasons[event.index]
        choices = [
            ChatChoice(index=i, message=ChatMessage(content=texts[i]),
                       finish_reason=reasons[i],  # type: ignore[arg-type]
                       logprobs=ChatLogprobs(content=logprobs[i]) if request.logprobs else None)
            for i in range(request.n)
        ]
        return ChatCompletionResponse(id=response_id, model=self.model_name(request),
                                      choices=choices, usage=usage_model(usage))

    async def stream(self, request: ChatCompletionRequest, response_id: str,
                     events: RouterEvents) -> AsyncIterator[bytes]:
        created = int(time.time())
        model = self.model_name(request)

        def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=response_id, created=created, model=model,
                                       choices=choices)

        template = ChunkTemplate(chunk([ChatChunkChoice(
            index=ChunkTemplate.INDEX_MARKER, delta=ChatDelta(content=ChunkTemplate.TEXT_MARKER))]))

        def encode(event: DeltaEvent) -> bytes:
            if not (event.text or event.logprobs):
                # Nothing to show (a token that ends inside a UTF-8 character): no chunk, or
                # only the finish reason with an empty delta, as OpenAI sends it.
                if event.finish_reason is None:
                    return b""
                return encode_event(chunk([ChatChunkChoice(
                    index=event.index, delta=ChatDelta(),
                    finish_reason=event.finish_reason)]))  # type: ignore[arg-type]
            if not request.logprobs:
                return template.encode(event.index, event.text, event.finish_reason)
            logprobs = ChatLogprobs(content=chat_logprobs(event.logprobs))
            return encode_event(chunk([ChatChunkChoice(
                index=event.index, delta=ChatDelta(content=event.text), logprobs=logprobs,
                finish_reason=event.finish_reason)]))  # type: ignore[arg-type]

        # The role chunks go out with the first events (the response starts once they came).
        head = b"".join(
            encode_event(chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))]))
            for index in range(request.n))
        async for batch in events:
            if not isinstance(batch, UsageTotals):
                data = head + b"".join(encode(e) for e in batch if isinstance(e, DeltaEvent))
                head = b""
                if data:
                    yield data
            else:
                if request.include_usage_in_stream:
                    usage_chunk = chunk([])
                    usage_chunk.usage = usage_model(batch)
                    head += encode_event(usage_chunk)
                if head:
                    yield head
