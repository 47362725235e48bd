"""What one request has sent its client so far, choice by choice (token ids, text pieces,
finish reasons, the engine's usage), and the events that carry it into the client stream's
outbox. The relays (output_relays.py) hand it one engine message or completion chunk at a
time; a resume continues from the tokens it holds (attempt_request.py)."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence

import grpc

from microserving.v1 import common_pb2, engine_pb2, router_pb2
from router.openai_proto import TEXT_TO_FINISH, logprobs_to_proto
from router.openai_protocol import CompletionResponse
from router.outbox import Outbox
from router.resumed_text import ResumedText

# An engine message of one request: a StartGenerate message or an Engine.Generate output.
EngineOutput = engine_pb2.StartGenerateResponse | engine_pb2.GenerateOutput


class AttemptOutcome(enum.Enum):
    DONE = "done"
    PREEMPTED = "preempted"


class RequestOutput:
    def __init__(self, request_id: str, num_choices: int, max_tokens: int | None,
                 num_prompt_tokens: int, outbox: Outbox) -> None:
        self.request_id = request_id
        self.num_choices = num_choices
        self.max_tokens = max_tokens  # the client's; None: up to the context
        self._num_prompt_tokens = num_prompt_tokens
        self._outbox = outbox
        self.streamed: list[list[int]] = [[] for _ in range(num_choices)]
        self._sent_text: list[list[str]] = [[] for _ in range(num_choices)]  # pieces, joined on resume
        self.finished: dict[int, int] = {}  # choice index -> FinishReason
        self.first_output_s = 0.0  # perf_counter when the first engine output arrived (0: none yet)
        self._completion_before_attempt = 0
        self._engine_completion: int | None = None
        self._cached_tokens = 0
        self._transferred_tokens = 0

    @property
    def num_streamed(self) -> int:
        return sum(len(ids) for ids in self.streamed)

    @property
    def resume_tokens(self) -> list[int]:
        """The tokens a resume continues after: the one choice's (n > 1 never resumes)."""
        return self.streamed[0] if self.num_choices == 1 else []

    @property
    def sent_text(self) -> str:
        """The text the client has of the one choice a resume continues."""
        return "".join(self._sent_text[0])

    def is_complete(self) -> bool:
        if len(self.finished) == self.num_choices:
            return True
        return self.max_tokens is not None and self.num_streamed >= self.max_tokens

    def begin_attempt(self) -> None:
        self._completion_before_attempt = self.num_streamed

    def take(self, message: EngineOutput, resumed: ResumedText | None) -> AttemptOutcome | None:
        """One engine message of this request: each ChoiceDelta goes to the outbox as it is
        unless a resume has the router decode the text. -> an outcome when the attempt ends
        here (preempt, or a stop string across the resume point), else None."""
        if not self.first_output_s:  # one float test per engine message, for TTFT
            self.first_output_s = time.perf_counter()
        for delta in message.choices:
            reason = delta.finish_reason
            if reason == common_pb2.FINISH_REASON_PREEMPT:
                return AttemptOutcome.PREEMPTED
            self.streamed[delta.index].extend(delta.token_ids)
            if resumed is None:
                self._sent_text[delta.index].append(delta.text)
                self._outbox.put_choice_delta(self.request_id, delta)
                if reason:
                    self.finished[delta.index] = reason
            else:
                self._put_choice(delta.index, delta.token_ids, delta.text, delta.logprobs, reason, resumed)
        if resumed is not None and self.is_complete():
            return AttemptOutcome.DONE  # a stop string across the resume point ended it
        if message.HasField("usage"):
            self._engine_completion = message.usage.completion_tokens
            self._cached_tokens = message.usage.cached_tokens
            self._transferred_tokens = message.usage.kv_transferred_tokens
        return None

    def take_completion(self, response: CompletionResponse | None,
                        resumed: ResumedText | None) -> AttemptOutcome | None:
        """One chunk of a custom translate_request (None: preempted), converted choice by
        choice. -> an outcome when the attempt ends here, else None."""
        if not self.first_output_s:
            self.first_output_s = time.perf_counter()
        if response is None:
            return AttemptOutcome.PREEMPTED
        for choice in response.choices:
            reason = TEXT_TO_FINISH.get(choice.finish_reason or "", 0)
            if reason == common_pb2.FINISH_REASON_PREEMPT:
                return AttemptOutcome.PREEMPTED
            ids = choice.token_ids or ()
            self.streamed[choice.index].extend(ids)
            self._put_choice(choice.index, ids, choice.text, logprobs_to_proto(choice.logprobs),
                             reason, resumed)
        if resumed is not None and self.is_complete():
            return AttemptOutcome.DONE  # a stop string across the resume point ended it
        if response.usage is not None:
            self._engine_completion = response.usage.completion_tokens
            extra = response.usage.extra or {}
            self._cached_tokens = int(extra.get("cached_tokens", 0))
            self._transferred_tokens = int(extra.get("kv_transferred_tokens", 0))
        return None

    def _put_choice(
        self, index: int, token_ids: Iterable[int], text: str, logprobs: Iterable[common_pb2.TokenLogprob],
        reason: int, resumed: ResumedText | None,
    ) -> None:
        """One choice's new output (its tokens already in `streamed`) to the outbox."""
        if resumed is not None:
            text, is_stopped = resumed.advance(self.streamed[index], bool(reason))
            reason = common_pb2.FINISH_REASON_STOP if is_stopped else reason
        self._sent_text[index].append(text)
        self._outbox.put_delta(self.request_id, index, token_ids, text, logprobs, reason)
        if reason:
            self.finished[index] = reason

    def _usage(self) -> common_pb2.Usage:
        prompt_tokens = self._num_prompt_tokens
        if self._engine_completion is not None:
            completion = self._completion_before_attempt + self._engine_completion
        else:
            completion = self.num_streamed
        return common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                                total_tokens=prompt_tokens + completion, cached_tokens=self._cached_tokens,
                                kv_transferred_tokens=self._transferred_tokens)

    def emit_prompt(self, prompt: router_pb2.PromptInfo) -> None:
        self._outbox.put(self.request_id, prompt=prompt)

    def emit_done(self, engines: Sequence[str], cancelled: bool = False) -> None:
        """One finish per choice (those without one: LENGTH, or ABORT when the client
        cancelled), then done with the usage and the engines that served the request."""
        default = common_pb2.FINISH_REASON_ABORT if cancelled else common_pb2.FINISH_REASON_LENGTH
        for index in range(self.num_choices):
            reason = self.finished.get(index, default)
            finish = router_pb2.ChoiceFinish(index=index, reason=reason)  # type: ignore[arg-type]
            self._outbox.put(self.request_id, finish=finish)
        done = router_pb2.RequestDone(usage=self._usage(), engines=engines)
        self._outbox.put(self.request_id, done=done)

    def emit_error(self, code: grpc.StatusCode, message: str, param: str) -> None:
        error = router_pb2.RequestError(code=code.value[0], message=message, param=param)
        self._outbox.put(self.request_id, error=error)

    def seal(self) -> None:
        self._outbox.seal(self.request_id, self.num_choices)
