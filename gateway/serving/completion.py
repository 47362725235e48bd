"""POST /v1/completions: router events -> OpenAI text_completion responses and chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

from gateway.protocol.completion import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from gateway.router_requests import completion_requests
from gateway.serving.base import GenerationServing, RouterEvents, usage_model
from gateway.serving.events import DeltaEvent, PromptEvent, UsageTotals
from gateway.sse import ChunkTemplate, encode_event
from microserving.token_bytes import TextOffsets, display_token
from microserving.v1 import common_pb2, router_pb2


def _token_text(token: common_pb2.TokenLogprob | common_pb2.TopLogprob) -> str:
    # From the raw bytes: a token inside a UTF-8 character shows as `bytes:\xNN`, so two such
    # alternatives stay two keys (their text would both be U+FFFD).
    return display_token(token.token_bytes) if token.token_bytes else token.token


@dataclass
class _LogprobsBuilder:
    """OpenAI's legacy logprobs layout, with text offsets counted over all returned text."""

    offsets: TextOffsets = field(default_factory=TextOffsets)
    logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)

    def add_prompt(self, text: str) -> None:
        self.offsets.offset += len(text)

    def add(self, tokens: Sequence[common_pb2.TokenLogprob]) -> CompletionLogprobs:
        chunk = CompletionLogprobs()
        for token in tokens:
            alternatives = {_token_text(alt): alt.logprob for alt in token.top_logprobs}
            offset = self.offsets.add(token.token_bytes or token.token.encode())
            for target in (chunk, self.logprobs):
                target.tokens.append(_token_text(token))
                target.token_logprobs.append(token.logprob)
                target.top_logprobs.append(alternatives or None)
                target.text_offset.append(offset)
        return chunk


class CompletionServing(GenerationServing[CompletionRequest]):
    id_prefix = "cmpl"

    def convert(self, request: CompletionRequest, base_id: str) -> list[router_pb2.NewRequest]:
        return completion_requests(request, base_id)

    def _choice_count(self, request: CompletionRequest) -> int:
        return len(request.prompts) * request.n

    async def complete(self, request: CompletionRequest, response_id: str,
                       events: RouterEvents) -> CompletionResponse:
        count = self._choice_count(request)
        texts = [""] * count
        reasons: list[str | None] = [None] * count
        builders = [_LogprobsBuilder() for _ in range(count)]
        usage = UsageTotals()
        async for batch in events:
            if isinstance(batch, UsageTotals):
                usage = batch
                continue
            for event in batch:
                if isinstance(event, PromptEvent):
                    for index in self._choices_of(request, event.prompt_index):
                        texts[index] += event.text
                        builders[index].add_prompt(event.text)
                else:
                    texts[event.index] += event.text
                    builders[event.index].add(event.logprobs)
                    reasons[event.index] = event.finish_reason or reasons[event.index]
        with_logprobs = request.logprobs is not None
        choices = [CompletionChoice(index=i, text=texts[i], finish_reason=reasons[i],  # type: ignore[arg-type]
                                    logprobs=builders[i].logprobs if with_logprobs else None)
                   for i in range(count)]
        return CompletionResponse(id=response_id, model=self.model_name(request), choices=choices,
                                  usage=usage_model(usage))

    def _choices_of(self, request: CompletionRequest, prompt_index: int) -> range:
        return range(prompt_index * request.n, (prompt_index + 1) * request.n)

    async def stream(self, request: CompletionRequest, response_id: str,
                     events: RouterEvents) -> AsyncIterator[bytes]:
        created = int(time.time())
        model = self.model_name(request)
        builders = [_LogprobsBuilder() for _ in range(self._choice_count(request))]
        with_logprobs = request.logprobs is not None

        def chunk(choices: list[CompletionChoice]) -> CompletionResponse:
            return CompletionResponse(id=response_id, created=created, model=model, choices=choices)

        template = ChunkTemplate(chunk([CompletionChoice(index=ChunkTemplate.INDEX_MARKER,
                                                         text=ChunkTemplate.TEXT_MARKER)]))

        def encode(event: PromptEvent | DeltaEvent) -> Iterator[bytes]:
            if isinstance(event, PromptEvent):
                for index in self._choices_of(request, event.prompt_index):
                    builders[index].add_prompt(event.text)
                    yield encode_event(chunk([CompletionChoice(index=index, text=event.text)]))
            elif not with_logprobs:
                yield template.encode(event.index, event.text, event.finish_reason)
            else:
                logprobs = builders[event.index].add(event.logprobs)
                yield encode_event(chunk([CompletionChoice(
                    index=event.index, text=event.text, logprobs=logprobs,
                    finish_reason=event.finish_reason)]))  # type: ignore[arg-type]

        async for batch in events:
            if not isinstance(batch, UsageTotals):
                yield b"".join(part for event in batch for part in encode(event))
            elif request.include_usage_in_stream:
                usage_chunk = chunk([])
                usage_chunk.usage = usage_model(batch)
                yield encode_event(usage_chunk)
