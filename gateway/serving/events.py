"""Router events -> the gateway's per-choice events, with exactly one finish per choice.

A request with P prompts and n choices each has P*n choices; choice `c` of prompt `p` is
OpenAI choice index `p * n + c`. The router may report a finish both on the last delta and in
a ChoiceFinish; only the first one is passed on. A RequestError raises a GatewayError.

Events come in batches: everything the router stream delivered since the HTTP request's task
last looked. Deltas of one choice within a batch are merged (tokens, text and logprobs in
order), so a client that lags gets one larger SSE chunk per choice instead of a backlog of
one-token chunks; a stream that keeps up gets each step's tokens as they come.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from gateway.errors import from_code_number
from gateway.metrics import GatewayMetrics
from gateway.router_client import RouterStream
from gateway.router_requests import finish_reason_text
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

    def followed_by(self, later: DeltaEvent) -> DeltaEvent:
        """This delta and a later one of the same choice, as one."""
        return DeltaEvent(self.index, self.text + later.text, [*self.token_ids, *later.token_ids],
                          [*self.logprobs, *later.logprobs], later.finish_reason)


Event = PromptEvent | DeltaEvent


def merge_deltas(events: list[Event]) -> list[Event]:
    """Each choice's deltas of one batch merged into its first (at that delta's place); a
    delta after a finish (none should come) starts anew."""
    merged: list[Event] = []
    open_at: dict[int, int] = {}  # choice index -> position of its unfinished delta in `merged`
    for event in events:
        if isinstance(event, DeltaEvent):
            at = open_at.get(event.index)
            if at is None:
                open_at[event.index] = len(merged)
                merged.append(event)
            else:
                earlier = merged[at]
                assert isinstance(earlier, DeltaEvent)  # open_at only points at deltas
                merged[at] = earlier.followed_by(event)
            if event.finish_reason is not None:
                open_at.pop(event.index, None)
        else:
            merged.append(event)
    return merged


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
        text = finish_reason_text(reason)
        self.metrics.finish_reasons.labels(text).inc()
        return DeltaEvent(index, "", (), (), text)

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
            self.metrics.finish_reasons.labels(reason).inc()
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


async def relay(stream: RouterStream, requests: Sequence[router_pb2.NewRequest], n: int,
                metrics: GatewayMetrics, started_s: float) -> AsyncIterator[list[Event] | UsageTotals]:
    """Starts `requests` on `stream` and yields their events in batches (deltas merged per
    choice), then the usage totals last."""
    state = RelayState({r.request_id: i for i, r in enumerate(requests)}, n, started_s, metrics)
    await stream.start(requests)
    async for router_events in stream.batches():
        events: list[Event] = []
        for router_event in router_events:
            events += state.translate(router_event)
        if events:
            yield merge_deltas(events) if len(events) > 1 else events
    yield state.usage
