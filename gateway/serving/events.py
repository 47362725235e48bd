"""Router events -> the gateway's per-choice events, with exactly one finish per choice.

A request with P prompts and n choices each has P*n choices; choice `c` of prompt `p` is
OpenAI choice index `p * n + c`. The router may report a finish both on the last delta and in
a ChoiceFinish; only the first one is passed on. A RequestError raises a GatewayError.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from gateway.conversion import finish_reason_text
from gateway.errors import from_code_number
from gateway.metrics import GatewayMetrics
from gateway.router_client import GenerateStream
from microserving.v1 import common_pb2, router_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptEvent:
    prompt_index: int
    token_ids: Sequence[int]
    text: str


@dataclass(frozen=True)
class DeltaEvent:
    index: int  # OpenAI choice index
    text: str
    token_ids: Sequence[int]
    logprobs: Sequence[common_pb2.TokenLogprob]
    finish_reason: str | None = None


Event = PromptEvent | DeltaEvent


@dataclass
class UsageTotals:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, usage: common_pb2.Usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.cached_tokens += usage.cached_tokens


@dataclass
class RelayState:
    """Bookkeeping of one HTTP request's router requests."""

    prompt_of: dict[str, int]
    n: int
    started_s: float
    metrics: GatewayMetrics
    usage: UsageTotals = field(default_factory=UsageTotals)
    finished: set[int] = field(default_factory=set)
    last_delta_s: dict[int, float] = field(default_factory=dict)

    def _timing(self, index: int) -> None:
        now = time.perf_counter()
        if not self.last_delta_s:
            self.metrics.time_to_first_token_s.observe(now - self.started_s)
        elif index in self.last_delta_s:
            self.metrics.inter_token_latency_s.observe(now - self.last_delta_s[index])
        self.last_delta_s[index] = now

    def _finish(self, index: int, reason: int) -> DeltaEvent | None:
        if index in self.finished:
            return None
        self.finished.add(index)
        return DeltaEvent(index, "", (), (), finish_reason_text(reason))

    def translate(self, event: router_pb2.GenerateResponse) -> list[Event]:
        prompt_index = self.prompt_of.get(event.request_id)
        if prompt_index is None:
            logger.warning("router event for unknown request %r", event.request_id)
            return []
        kind = event.WhichOneof("event")
        if kind == "prompt":
            return [PromptEvent(prompt_index, list(event.prompt.token_ids), event.prompt.text)]
        if kind == "delta":
            return self._delta(prompt_index, event.delta)
        if kind == "finish":
            finish = self._finish(prompt_index * self.n + event.finish.index, event.finish.reason)
            return [finish] if finish else []
        if kind == "done":
            return self._done(prompt_index, event.done)
        if kind == "error":
            error = event.error
            raise from_code_number(error.code, error.message, error.param)
        return []

    def _delta(self, prompt_index: int, delta: common_pb2.ChoiceDelta) -> list[Event]:
        index = prompt_index * self.n + delta.index
        if index in self.finished:
            return []
        self._timing(index)
        reason = None
        if delta.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.finished.add(index)
            reason = finish_reason_text(delta.finish_reason)
        # The message's repeated fields are read in place (no copies on the hot path).
        return [DeltaEvent(index, delta.text, delta.token_ids, delta.logprobs, reason)]

    def _done(self, prompt_index: int, done: router_pb2.RequestDone) -> list[Event]:
        self.usage.add(done.usage)
        self.metrics.prompt_tokens.inc(done.usage.prompt_tokens)
        self.metrics.completion_tokens.inc(done.usage.completion_tokens)
        missing = [prompt_index * self.n + c for c in range(self.n)
                   if prompt_index * self.n + c not in self.finished]
        if missing:
            logger.warning("router finished request without finishing choices %s", missing)
        events: list[Event] = []
        for index in missing:
            finish = self._finish(index, common_pb2.FINISH_REASON_STOP)
            if finish:
                events.append(finish)
        return events


async def relay(stream: GenerateStream, requests: Sequence[router_pb2.NewRequest], n: int,
                metrics: GatewayMetrics, started_s: float) -> AsyncIterator[Event | UsageTotals]:
    """Starts `requests` on `stream` and yields their events, then the usage totals last."""
    state = RelayState({r.request_id: i for i, r in enumerate(requests)}, n, started_s, metrics)
    await stream.start(requests)
    async for router_event in stream.events():
        for event in state.translate(router_event):
            yield event
    yield state.usage
