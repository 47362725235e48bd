"""Runs one client request through Router.translate_request and relays its output.

Two relays, one set of rules: with the built-in patterns the engine's ChoiceDelta protos go
to the client as they are (`_take`, fed by the engine's multiplexed stream in
`_relay_streamed`, or by a StartGenerate call in `_relay_messages`); a custom
translate_request's CompletionResponse chunks are converted choice by choice
(`_relay_completions`).

Owns the request-level guarantees: retry on another engine before the first token was
streamed; after it, a bounded resume (on another engine after an engine failure, through the
pattern again after a preempt) from prompt + tokens already streamed, so text is never
duplicated; Abort fanned out to every engine an attempt touched whenever it did not finish
cleanly (failure, cancel, preempt); exactly one finish per choice, then one done or one
error.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Iterable

import grpc

from microserving import tracing
from microserving.v1 import common_pb2, engine_pb2, router_pb2
from router.attempt import Attempt, EngineJob
from router.engine_calls import Messages
from router.errors import EngineCallError, OverloadedError, PreemptedTooOftenError, RouterError
from router.kv_room import RoomBackoff
from router.openai_proto import (
    TEXT_TO_FINISH,
    engine_sampling,
    logprobs_to_proto,
    sampling_to_request_fields,
)
from router.openai_protocol import CompletionRequest, CompletionResponse
from router.outbox import Outbox
from router.placement import pattern_name
from router.prepared_request import PreparedRequest
from router.resumed_text import ResumedText
from router.router import ATTEMPT_CACHE_SALT, Router
from router.streamed_decode import StreamedDecode

logger = logging.getLogger(__name__)


# An engine message of one request: a StartGenerate message or an Engine.Generate output.
EngineOutput = engine_pb2.StartGenerateResponse | engine_pb2.GenerateOutput


class _Outcome(enum.Enum):
    DONE = "done"
    PREEMPTED = "preempted"


class RequestRunner:
    def __init__(self, router: Router, prepared: PreparedRequest, outbox: Outbox,
                 arrived_s: float | None = None, span: tracing.Span | None = None) -> None:
        self._router = router
        self._arrived_s = time.perf_counter() if arrived_s is None else arrived_s  # perf_counter
        self._first_output_s = 0.0  # when the first engine output arrived (0: none yet)
        self._prepared = prepared
        self._outbox = outbox
        sampling = prepared.sampling
        self._num_choices = sampling.n if sampling.HasField("n") else 1
        self._streamed: list[list[int]] = [[] for _ in range(self._num_choices)]
        self._sent_text: list[list[str]] = [[] for _ in range(self._num_choices)]  # pieces, joined on resume
        self._sampling = engine_sampling(sampling)  # what the engines get on a first attempt
        self._finished: dict[int, int] = {}
        self._completion_before_attempt = 0
        self._cached_tokens = 0
        self._transferred_tokens = 0
        self._engine_completion: int | None = None
        self._id_base = uuid.uuid4().hex
        self._traceparent = span.traceparent if span is not None else ""
        if span is not None:
            span.set_attribute("microserving.engine_request_id_base", self._id_base)
        # The id mapping, once per request and with the trace id, so an operator can follow one
        # request: the gateway's id (its response id + prompt index) -> the engines' ids.
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request %s (trace %s): engine request ids %s-<attempt number from 0>",
                         prepared.request_id, tracing.trace_id_of(self._traceparent), self._id_base)
        self._engines: list[str] = []
        self._room = RoomBackoff()  # pauses while no engine has room for the request's KV

    @property
    def num_streamed(self) -> int:
        return sum(len(ids) for ids in self._streamed)

    async def run(self) -> None:
        rid = self._prepared.request_id
        outcome = "error"
        try:
            if self._prepared.echo:
                prompt = router_pb2.PromptInfo(token_ids=self._prepared.token_ids, text=self._prepared.prompt_text)
                self._outbox.put(rid, prompt=prompt)
            await self._run_attempts()
            self._emit_done()
            outcome = "done"
        except asyncio.CancelledError:
            self._emit_done(cancelled=True)  # the client cancelled this request
            outcome = "cancelled"
        except RouterError as exc:
            self._emit_error(*exc.client_view())
        except Exception:
            logger.exception("request %s failed", rid)
            self._emit_error(grpc.StatusCode.INTERNAL, "internal router error", "")
        finally:
            self._outbox.seal(rid, self._num_choices)
            self._observe(outcome)

    def _observe(self, outcome: str) -> None:
        """The request's metrics, once at its end: outcome, latency, TTFT and mean ITL."""
        metrics = self._router.metrics
        now_s = time.perf_counter()
        pattern = (pattern_name(self._router.router_mode, self._prepared.hints)
                   if self._router.uses_builtin_patterns else "custom")
        metrics.requests.labels(pattern, outcome).inc()
        metrics.e2e_latency_s.labels(pattern).observe(now_s - self._arrived_s)
        if not self._first_output_s:
            return
        engine = self._engines[0] if self._engines else "unknown"  # the decode engine
        metrics.time_to_first_token_s.labels(pattern, engine).observe(self._first_output_s - self._arrived_s)
        num_tokens = max(len(ids) for ids in self._streamed)  # of the longest choice
        if num_tokens > 1:
            mean_itl_s = (now_s - self._first_output_s) / (num_tokens - 1)
            metrics.inter_token_latency_s.labels(pattern, engine).observe(mean_itl_s)

    async def _run_attempts(self) -> None:
        settings = self._router.settings
        excluded: set[str] = set()
        num_failures = num_preempts = num_attempts = 0
        streamed_at_preempt = -1  # num_streamed at the last preempt
        stalled_since_s = 0.0  # the first of the preempts in a row without a new token
        has_fallen_back = False
        while True:
            # Every attempt its own engine request id: one that ends is aborted on its engines,
            # and an id used again could meet that Abort or the old attempt's remains there.
            attempt = Attempt(f"{self._id_base}-{num_attempts}",
                              hints=self._prepared.hints, excluded=set(excluded),
                              cache_salt=self._prepared.sampling.cache_salt,
                              traceparent=self._traceparent)
            num_attempts += 1
            try:
                outcome = await self._attempt(attempt)
            except EngineCallError as exc:
                await _abort(self._router, attempt, faulty=exc.address if exc.is_engine_fault else None)
                if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and await self._wait_for_room():
                    continue  # a full pool is no fault: the same engines again, after a pause
                if exc.code == grpc.StatusCode.UNIMPLEMENTED and attempt.use_engine_stream and not has_fallen_back:
                    # An engine without Engine.Generate (nothing was streamed): run the attempt
                    # again; the engine's stream is marked unsupported, so it uses StartGenerate.
                    has_fallen_back = True
                    continue
                num_failures += 1
                if not exc.is_retryable or num_failures >= settings.max_attempts or not self._can_resume():
                    raise
                excluded.add(exc.address)
                failed_over = self._router.metrics.resumes if self.num_streamed else self._router.metrics.retries
                failed_over.labels(exc.address).inc()
                if self._is_complete():
                    return
                # Before the first token this is a plain retry; after it, the next attempt
                # resumes from prompt + streamed tokens (see _request), so no text repeats.
                logger.info("%s %s elsewhere after %s", "resuming" if self.num_streamed else "retrying",
                            self._prepared.request_id, exc.message)
                continue
            except OverloadedError:
                await _abort(self._router, attempt)
                if self.num_streamed and await self._wait_for_room():
                    continue  # a resume waits for room as long as for its next token
                raise
            except BaseException:
                await _abort(self._router, attempt)
                raise
            finally:
                self._router.close_attempt(attempt)
            if outcome is _Outcome.DONE:
                self._engines = attempt.used
                return
            await _abort(self._router, attempt)
            # The bound is on preempts in a row without a new token (one after progress is no
            # loop): more than max_preempt_retries and for longer than the inter-token deadline.
            # A resume is the newest request on its engine, the first one preempted again, so
            # on a tight pool it may lose several times until the others finish.
            num_preempts = num_preempts + 1 if self.num_streamed == streamed_at_preempt else 1
            if num_preempts == 1:
                stalled_since_s = time.monotonic()
            streamed_at_preempt = self.num_streamed
            self._router.metrics.preemptions.inc()
            is_stalled = time.monotonic() - stalled_since_s > settings.inter_token_timeout_s
            if num_preempts > settings.max_preempt_retries and is_stalled:
                raise PreemptedTooOftenError("the request was preempted too often; try again later")
            if self.num_streamed and self._num_choices > 1:
                raise PreemptedTooOftenError("preempted after streaming; n > 1 cannot be resumed")
            if self._is_complete():
                return

    async def _wait_for_room(self) -> bool:
        """Pause before trying the engines again for room for this request's KV -> False
        once the bound has passed: the KV-full wait for a request that has streamed nothing
        (then the client gets RESOURCE_EXHAUSTED / 429), the inter-token deadline for a
        resume (its client waits for the next token; a preempted request that has streamed
        is finished rather than refused when the pool frees up)."""
        settings = self._router.settings
        max_wait_s = settings.inter_token_timeout_s if self.num_streamed else settings.kv_full_wait_s
        return await self._room.pause(self.num_streamed, max_wait_s)

    def _can_resume(self) -> bool:
        """Nothing streamed yet, or one choice whose tokens a resume can continue from."""
        return not self.num_streamed or self._num_choices == 1

    def _is_complete(self) -> bool:
        if len(self._finished) == self._num_choices:
            return True
        max_tokens = self._max_tokens()
        return max_tokens is not None and self.num_streamed >= max_tokens

    def _max_tokens(self) -> int | None:
        sampling = self._prepared.sampling
        return sampling.max_tokens if sampling.HasField("max_tokens") else None

    def _request(self, engine_request_id: str) -> CompletionRequest:
        """The request of the next attempt: a resume continues after the streamed tokens."""
        fields = sampling_to_request_fields(self._prepared.sampling)
        streamed = self._streamed[0] if self._num_choices == 1 else []
        max_tokens = self._max_tokens()
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens - len(streamed)
        return CompletionRequest.model_validate({
            **fields, "model": self._prepared.model, "stream": True, "user": engine_request_id,
            "prompt": [*self._prepared.token_ids, *streamed],
        })

    def _job(self, engine_request_id: str) -> EngineJob:
        """The engine-level request of the next attempt (the fast path's _request)."""
        streamed = self._streamed[0] if self._num_choices == 1 else []
        if not streamed:
            return EngineJob(engine_request_id, list(self._prepared.token_ids), self._sampling)
        max_tokens = self._max_tokens()
        sampling = engine_sampling(self._sampling, None if max_tokens is None else max_tokens - len(streamed))
        return EngineJob(engine_request_id, [*self._prepared.token_ids, *streamed], sampling)

    async def _attempt(self, attempt: Attempt) -> _Outcome:
        self._completion_before_attempt = self.num_streamed
        resumed = None
        if self.num_streamed:  # a resume: the router decodes the text (see resumed_text.py)
            sent = "".join(self._sent_text[0])
            resumed = ResumedText(self._router.tokenizer, sent, self._prepared.sampling.stop)
        if self._router.uses_builtin_patterns:
            attempt.use_engine_stream = self._router.settings.engine_stream
            decode = await self._router.generate(self._job(attempt.engine_request_id), attempt)
            if isinstance(decode, StreamedDecode):
                return await self._relay_streamed(decode, resumed)
            return await self._relay_messages(decode, resumed)
        self._router.open_attempt(attempt)  # translate_request gets only the request id
        request = self._request(attempt.engine_request_id)
        scope = ATTEMPT_CACHE_SALT.set(attempt.cache_salt)  # for engine calls under ids of its own
        try:
            return await self._relay_completions(
                self._router.translate_request(request, attempt.engine_request_id), resumed)
        finally:
            ATTEMPT_CACHE_SALT.reset(scope)

    async def _relay_messages(self, messages: Messages, resumed: ResumedText | None) -> _Outcome:
        """The built-in patterns' StartGenerate messages (engine_stream off)."""
        async with contextlib.aclosing(messages):
            async for message in messages:
                outcome = self._take(message, resumed)
                if outcome is not None:
                    return outcome
        return _Outcome.DONE

    async def _relay_streamed(self, decode: StreamedDecode[_Outcome], resumed: ResumedText | None) -> _Outcome:
        """The built-in patterns' decode on the engine's multiplexed stream: the stream's
        reader hands each output of this request to `_take` directly (no task switch per
        message); this task wakes once, when the request ends."""
        outcome = await decode.run(functools.partial(self._take, resumed=resumed))
        return _Outcome.DONE if outcome is None else outcome

    def _take(self, message: EngineOutput, resumed: ResumedText | None) -> _Outcome | None:
        """One engine message of this request: each ChoiceDelta goes to the outbox as it is
        unless a resume has the router decode the text. -> an outcome when the attempt ends
        here (preempt, or a stop string across the resume point), else None."""
        rid = self._prepared.request_id
        if not self._first_output_s:  # one float test per engine message, for TTFT
            self._first_output_s = time.perf_counter()
        for delta in message.choices:
            reason = delta.finish_reason
            if reason == common_pb2.FINISH_REASON_PREEMPT:
                return _Outcome.PREEMPTED
            self._streamed[delta.index].extend(delta.token_ids)
            if resumed is None:
                self._sent_text[delta.index].append(delta.text)
                self._outbox.put_choice_delta(rid, delta)
                if reason:
                    self._finished[delta.index] = reason
            else:
                self._relay_choice(delta.index, delta.token_ids, delta.text, delta.logprobs, reason, resumed)
        if resumed is not None and self._is_complete():
            return _Outcome.DONE  # a stop string across the resume point ended it
        if message.HasField("usage"):
            self._engine_completion = message.usage.completion_tokens
            self._cached_tokens = message.usage.cached_tokens
            self._transferred_tokens = message.usage.kv_transferred_tokens
        return None

    async def _relay_completions(
        self, generator: AsyncGenerator[CompletionResponse | None, None], resumed: ResumedText | None
    ) -> _Outcome:
        """A custom translate_request's CompletionResponse chunks."""
        async with contextlib.aclosing(generator):
            async for response in generator:
                if not self._first_output_s:
                    self._first_output_s = time.perf_counter()
                if response is None:
                    return _Outcome.PREEMPTED
                for choice in response.choices:
                    reason = TEXT_TO_FINISH.get(choice.finish_reason or "", 0)
                    if reason == common_pb2.FINISH_REASON_PREEMPT:
                        return _Outcome.PREEMPTED
                    ids = choice.token_ids or ()
                    self._streamed[choice.index].extend(ids)
                    self._relay_choice(choice.index, ids, choice.text, logprobs_to_proto(choice.logprobs),
                                       reason, resumed)
                if resumed is not None and self._is_complete():
                    return _Outcome.DONE  # a stop string across the resume point ended it
                if response.usage is not None:
                    self._engine_completion = response.usage.completion_tokens
                    extra = response.usage.extra or {}
                    self._cached_tokens = int(extra.get("cached_tokens", 0))
                    self._transferred_tokens = int(extra.get("kv_transferred_tokens", 0))
        return _Outcome.DONE

    def _relay_choice(
        self, index: int, token_ids: Iterable[int], text: str, logprobs: Iterable[common_pb2.TokenLogprob],
        reason: int, resumed: ResumedText | None,
    ) -> None:
        """One choice's new output (its tokens already in _streamed) to the outbox."""
        if resumed is not None:
            text, is_stopped = resumed.advance(self._streamed[index], bool(reason))
            reason = common_pb2.FINISH_REASON_STOP if is_stopped else reason
        self._sent_text[index].append(text)
        self._outbox.put_delta(self._prepared.request_id, index, token_ids, text, logprobs, reason)
        if reason:
            self._finished[index] = reason

    def _usage(self) -> common_pb2.Usage:
        prompt_tokens = len(self._prepared.token_ids)
        if self._engine_completion is not None:
            completion = self._completion_before_attempt + self._engine_completion
        else:
            completion = self.num_streamed
        return common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                                total_tokens=prompt_tokens + completion, cached_tokens=self._cached_tokens,
                                kv_transferred_tokens=self._transferred_tokens)

    def _emit_done(self, cancelled: bool = False) -> None:
        rid = self._prepared.request_id
        default = common_pb2.FINISH_REASON_ABORT if cancelled else common_pb2.FINISH_REASON_LENGTH
        for index in range(self._num_choices):
            reason = self._finished.get(index, default)
            finish = router_pb2.ChoiceFinish(index=index, reason=reason)  # type: ignore[arg-type]
            self._outbox.put(rid, finish=finish)
        done = router_pb2.RequestDone(usage=self._usage(), engines=self._engines)
        self._outbox.put(rid, done=done)

    def _emit_error(self, code: grpc.StatusCode, message: str, param: str) -> None:
        error = router_pb2.RequestError(code=code.value[0], message=message, param=param)
        self._outbox.put(self._prepared.request_id, error=error)


# Aborts sent to engines that just failed; kept referenced until they end.
_detached_aborts: set[asyncio.Task[None]] = set()


async def _abort(router: Router, attempt: Attempt, faulty: str | None = None) -> None:
    """Abort on every touched engine; shielded so a second cancel cannot skip the cleanup.

    The Abort to a `faulty` engine (dead or stalled) runs detached: a stalled engine would
    hold the retry for the whole Abort deadline, and it is out of rotation anyway."""
    engines, request_id = router.engines, attempt.engine_request_id
    rest = [a for a in attempt.touched if a != faulty]
    if faulty is not None and faulty in attempt.touched:
        task = asyncio.get_running_loop().create_task(engines.abort(request_id, [faulty]))
        _detached_aborts.add(task)
        task.add_done_callback(_detached_aborts.discard)
    if rest:
        await asyncio.shield(engines.abort(request_id, rest))
