"""Runs one client request through its attempts: the built-in patterns (Router.generate) or a
custom Router.translate_request, each attempt's output relayed (output_relays.py) into what
the client has been sent (request_output.py).

Owns the request-level guarantees: retry on another engine before the first token was
streamed; after it, a bounded resume (on another engine after an engine failure, through the
pattern again after a preempt) from prompt + tokens already streamed (attempt_request.py), so
text is never duplicated; Abort fanned out to every engine an attempt touched whenever it did
not finish cleanly (failure, cancel, preempt; Engines.abort_attempt); exactly one finish per
choice, then one done or one error.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from microserving import tracing
from microserving.v1 import router_pb2
from router.attempt import Attempt
from router.attempt_request import completion_request, engine_job, max_tokens_of
from router.errors import EngineCallError, OverloadedError, PreemptedTooOftenError, RouterError
from router.kv_room import RoomBackoff
from router.openai_proto import engine_sampling
from router.outbox import Outbox
from router.output_relays import relay_completions, relay_messages, relay_streamed
from router.placement import pattern_name
from router.prepared_request import PreparedRequest
from router.request_output import AttemptOutcome, RequestOutput
from router.resumed_text import ResumedText
from router.router import ATTEMPT_CACHE_SALT, Router
from router.streamed_decode import StreamedDecode

logger = logging.getLogger(__name__)


class RequestRunner:
    def __init__(self, router: Router, prepared: PreparedRequest, outbox: Outbox,
                 arrived_s: float | None = None, span: tracing.Span | None = None) -> None:
        self._router = router
        self._arrived_s = time.perf_counter() if arrived_s is None else arrived_s  # perf_counter
        self._prepared = prepared
        sampling = prepared.sampling
        self._output = RequestOutput(prepared.request_id, sampling.n if sampling.HasField("n") else 1,
                                     max_tokens_of(sampling), len(prepared.token_ids), outbox)
        self._sampling = engine_sampling(sampling)  # what the engines get on a first attempt
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
        return self._output.num_streamed

    async def run(self) -> None:
        rid = self._prepared.request_id
        outcome = "error"
        try:
            if self._prepared.echo:
                prompt = router_pb2.PromptInfo(token_ids=self._prepared.token_ids, text=self._prepared.prompt_text)
                self._output.emit_prompt(prompt)
            await self._run_attempts()
            self._output.emit_done(self._engines)
            outcome = "done"
        except asyncio.CancelledError:
            self._output.emit_done(self._engines, cancelled=True)  # the client cancelled this request
            outcome = "cancelled"
        except RouterError as exc:
            self._output.emit_error(*exc.client_view())
        except Exception:
            logger.exception("request %s failed", rid)
            self._output.emit_error(grpc.StatusCode.INTERNAL, "internal router error", "")
        finally:
            self._output.seal()
            self._observe(outcome)

    def _observe(self, outcome: str) -> None:
        """The request's metrics, once at its end: outcome, latency, TTFT and mean ITL."""
        metrics = self._router.metrics
        now_s = time.perf_counter()
        pattern = (pattern_name(self._router.router_mode, self._prepared.hints)
                   if self._router.uses_builtin_patterns else "custom")
        metrics.requests.labels(pattern, outcome).inc()
        metrics.e2e_latency_s.labels(pattern).observe(now_s - self._arrived_s)
        first_output_s = self._output.first_output_s
        if not first_output_s:
            return
        engine = self._engines[0] if self._engines else "unknown"  # the decode engine
        metrics.time_to_first_token_s.labels(pattern, engine).observe(first_output_s - self._arrived_s)
        num_tokens = max(len(ids) for ids in self._output.streamed)  # of the longest choice
        if num_tokens > 1:
            mean_itl_s = (now_s - first_output_s) / (num_tokens - 1)
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
                await self._router.engines.abort_attempt(attempt, exc.address if exc.is_engine_fault else None)
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
                if self._output.is_complete():
                    return
                # Before the first token this is a plain retry; after it, the next attempt
                # resumes from prompt + streamed tokens (attempt_request.py), so no text repeats.
                logger.info("%s %s elsewhere after %s", "resuming" if self.num_streamed else "retrying",
                            self._prepared.request_id, exc.message)
                continue
            except OverloadedError:
                await self._router.engines.abort_attempt(attempt)
                if self.num_streamed and await self._wait_for_room():
                    continue  # a resume waits for room as long as for its next token
                raise
            except BaseException:
                await self._router.engines.abort_attempt(attempt)
                raise
            finally:
                self._router.close_attempt(attempt)
            if outcome is AttemptOutcome.DONE:
                self._engines = attempt.used
                return
            await self._router.engines.abort_attempt(attempt)
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
            if self.num_streamed and self._output.num_choices > 1:
                raise PreemptedTooOftenError("preempted after streaming; n > 1 cannot be resumed")
            if self._output.is_complete():
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
        return not self.num_streamed or self._output.num_choices == 1

    async def _attempt(self, attempt: Attempt) -> AttemptOutcome:
        output = self._output
        output.begin_attempt()
        resumed = None
        if self.num_streamed:  # a resume: the router decodes the text (see resumed_text.py)
            resumed = ResumedText(self._router.tokenizer, output.sent_text, self._prepared.sampling.stop)
        if self._router.uses_builtin_patterns:
            attempt.use_engine_stream = self._router.settings.engine_stream
            job = engine_job(self._prepared, self._sampling, output.resume_tokens, attempt.engine_request_id)
            decode = await self._router.generate(job, attempt)
            if isinstance(decode, StreamedDecode):
                return await relay_streamed(decode, output, resumed)
            return await relay_messages(decode, output, resumed)
        self._router.open_attempt(attempt)  # translate_request gets only the request id
        request = completion_request(self._prepared, output.resume_tokens, attempt.engine_request_id)
        scope = ATTEMPT_CACHE_SALT.set(attempt.cache_salt)  # for engine calls under ids of its own
        try:
            return await relay_completions(
                self._router.translate_request(request, attempt.engine_request_id), output, resumed)
        finally:
            ATTEMPT_CACHE_SALT.reset(scope)
