"""BENCHMARK ONLY. SyntheticCore: a stand-in for LLMEngine that computes nothing. It keeps
LLMEngine's interface (the parts AsyncEngine and EmbeddedBackend call), admits requests up to
max_num_seqs, holds a count of fake KV pages, and each `step()` emits one token per running
sequence, taking as long as the GPU profile says a step of that batch takes.

The step's wall time is a sleep (it releases the GIL, as waiting on a GPU does) until the
step's end on a simulated device clock (device_clock.py), so the host work done inside the
step (text, deltas) overlaps the "device" as it does in the real engine.

Output goes through the real engine's per-request machinery (engine/request.py: add_token,
the byte tokenizer's incremental decoder, stop strings, take_output), so detokenization costs
what it costs in the real engine. The send/receive half is in transfer.py.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceT
from typing import Any, cast

from engine_shim.backends.synthetic.device_clock import DeviceClock
from engine_shim.backends.synthetic.pages import DEFAULT_NUM_PAGES, PagePool
from engine_shim.backends.synthetic.profile import StepProfile
from engine_shim.backends.synthetic.tokens import TokenStream, refuse_unmodelled
from engine_shim.backends.synthetic.transfer import TransferOps
from engine_shim.engine import validation
from engine_shim.engine.api import (
    AlreadyExistsError,
    Continuation,
    EngineStatus,
    FailedPreconditionError,
    FinishReason,
    KVLayout,
    PackedOutput,
    SamplingParams,
    StatusFields,
    constant_status,
    status_from_fields,
)
from engine_shim.engine.config import MODEL_PRESETS, EngineConfig
from engine_shim.engine.disaggregation import EngineEvent, FirstTokens, SendReady
from engine_shim.engine.request import (
    Choice,
    GenerateRequest,
    add_token,
    finish_choice,
    first_token_request,
    replay_tokens,
    stop_token_ids,
    take_output,
)
from engine_shim.engine.sequence import SeqKind, SeqStatus, Sequence
from microserving.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_BLOCKED_WAIT_S = 0.001  # waiting work that cannot be admitted: don't spin


class SyntheticCore(TransferOps):
    """Not thread-safe, like LLMEngine: one caller (AsyncEngine's thread) drives it."""

    def __init__(
        self,
        config: EngineConfig,
        profile: StepProfile,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if config.model not in MODEL_PRESETS:
            raise ValueError(
                f"the synthetic backend emits byte-level tokens: --model must be a preset "
                f"{tuple(MODEL_PRESETS)}, not {config.model!r}"
            )
        self.config = config
        self.profile = profile
        self._clock, self._sleep = clock, sleep
        self.tokenizer = Tokenizer.from_model(config.model)
        model = MODEL_PRESETS[config.model]
        self.model_id = config.model
        self.vocab_size = model.vocab_size
        self.max_context_length = min(
            config.max_context_length or model.max_position_embeddings, model.max_position_embeddings
        )
        self.page_size = config.page_size
        self.pages = PagePool(config.num_pages or DEFAULT_NUM_PAGES, config.page_size)
        self._requests: dict[str, GenerateRequest] = {}
        self._streams: dict[Choice, TokenStream] = {}
        self._waiting: deque[Sequence] = deque()  # prompt KV still to compute, in order
        self._running: list[Sequence] = []  # decode rows
        self._events: list[EngineEvent | PackedOutput] = []
        # Outputs as plain tuples (api.PackedOutput), as LLMEngine makes them for a core in a
        # process of its own (core_process.py sets it there).
        self.packs_outputs = False
        self._device = DeviceClock()
        self._next_seq_id = 0
        self.num_steps = 0
        self.busy_time_s = 0.0  # its loop's work, idle waits left out (core_loop); not reported
        TransferOps.__init__(self)

    # ---- facts ----
    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.pages.num_free_pages

    @property
    def kv_layout(self) -> KVLayout:
        # One float per token and side: KV chunks stay tiny but travel the real data plane.
        return KVLayout(
            model_fingerprint=f"synthetic:{self.model_id}",
            dtype="float32",
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            page_size=self.page_size,
        )

    @property
    def has_work(self) -> bool:
        return bool(self._events or self._running or self._waiting)

    def is_active(self, request_id: str) -> bool:
        return (
            request_id in self._requests or request_id in self._sends
            or request_id in self._reservations
        )

    def warmup(self) -> None:
        """Nothing to warm up (AsyncEngine calls it, as on LLMEngine)."""

    # ---- generate ----
    def start_generate(
        self, request_id: str, token_ids: SequenceT[int], begin: int, sampling: SamplingParams,
        after_kv: bool = False, continuations: SequenceT[Continuation] = (),
    ) -> None:
        """As LLMEngine.start_generate, `after_kv` and `continuations` included."""
        request_id = validation.check_request_id(request_id)
        ids = validation.check_token_ids(token_ids, self.vocab_size)
        b = validation.check_start_generate_begin(begin, len(ids), continues=bool(continuations))
        max_tokens = validation.check_sampling(
            sampling, self.vocab_size, self.max_context_length, len(ids)
        )
        refuse_unmodelled(sampling)
        validation.check_continuations(continuations, sampling.n, self.vocab_size)
        if request_id in self._requests or request_id in self._sends or request_id in self._kv_waits:
            raise AlreadyExistsError(f"request {request_id!r} is already active")
        self.pages.check_fits(len(ids) + 1)
        if after_kv and not self._kv_is_filled(request_id, ids, b):
            self._kv_waits.wait(
                request_id, lambda: self.start_generate(request_id, ids, b, sampling, continuations=continuations))
            return
        seq = self._new_seq(request_id, ids, SeqKind.GENERATE)
        reservation = self._reservations.get(request_id)
        if reservation is None and b != 0:
            raise FailedPreconditionError(
                f"start_generate without prep_recv: begin={b} needs KV that this engine lacks"
            )
        if reservation is not None:
            self._check_reservation_covers(reservation, ids, b)
            del self._reservations[request_id]
            seq.block_table = reservation.pages
            seq.num_computed_tokens = seq.num_cached_tokens = b
            seq.is_disaggregated = True
        request = GenerateRequest(
            request_id=request_id,
            sampling=sampling,
            max_tokens=max_tokens,
            num_prompt_tokens=len(ids),
            stop_token_ids=stop_token_ids(sampling, self.tokenizer.eos_token_ids),
            choices=[] if continuations else [self._new_choice(0, seq, sampling)],
        )
        self._requests[request_id] = request
        if continuations:
            self._continue(request, seq, continuations)
            return
        self._waiting.append(seq)

    def _continue(self, request: GenerateRequest, seq: Sequence, continuations: SequenceT[Continuation]) -> None:
        """As LLMEngine's: each choice from its continuation, its token stream past the
        tokens the sender drew; the first that goes on takes the reservation's pages."""
        request.is_forked = True
        holder: Sequence | None = None
        for index, token_ids, _ in continuations:
            child = seq if holder is None else \
                self._new_seq(seq.request_id, seq.token_ids[:request.num_prompt_tokens], SeqKind.GENERATE)
            child.choice_index, child.is_disaggregated = index, True
            child.num_computed_tokens = child.num_cached_tokens = seq.num_computed_tokens
            choice = self._new_choice(index, child, request.sampling)
            for _ in token_ids:
                self._streams[choice].next()
            request.choices.append(choice)
            replay_tokens(request, choice, tuple(token_ids), self.tokenizer)
            if choice.is_finished:
                if child is seq:
                    choice.seq = self._new_seq(seq.request_id, list(child.token_ids), SeqKind.GENERATE)
                    choice.seq.num_prompt_tokens = request.num_prompt_tokens
                    del seq.token_ids[request.num_prompt_tokens:]
                choice.seq.status = SeqStatus.FINISHED
                self._streams.pop(choice, None)
                continue
            holder = holder or child
            self._waiting.append(child)
        if holder is None:  # every choice ended with the sender's tokens
            self.pages.release(seq.block_table)
            self._emit(request)

    def _first_request(self, request_id: str, ids: list[int], sampling: SamplingParams, max_tokens: int) -> GenerateRequest:
        """The request whose choices a sampling send job draws the first tokens of."""
        return first_token_request(request_id, ids, sampling, max_tokens,
                                   stop_token_ids(sampling, self.tokenizer.eos_token_ids),
                                   self._next_seq_id_now, self._new_choice)

    def _next_seq_id_now(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def abort(self, request_id: str) -> bool:
        """Free everything the request holds; True if it was active."""
        found = False
        request = self._requests.pop(request_id, None)
        if request is not None:
            found = True
            for choice in request.choices:
                if not choice.is_finished:
                    self._drop_seq(choice.seq)
                    finish_choice(choice, FinishReason.ABORT)
            output = take_output(request, self.packs_outputs, ended=True)
            assert output is not None  # an ended request always has its last output
            self._events.append(output)
        return self._abort_transfer(request_id) or found

    # ---- the step ----
    def step(self) -> list[EngineEvent | PackedOutput]:
        called_at = self._clock()
        self.reap_expired_reservations()
        decoding = list(self._running)
        prefilling, num_prefill_tokens, joins = self._admit()
        batch_size = len(decoding) + len(prefilling)
        if batch_size == 0:
            self._device.idle()
            if self._waiting and not self._events:
                self._sleep(_BLOCKED_WAIT_S)
            return self._take_events()
        # As the engine's chained steps: new sequences that only decode (continuations from a
        # whole-prompt reservation) join the chain; any prefill needs the host's schedule.
        ends_at = self._device.step_ends_at(
            called_at, self.profile.step_s(batch_size, num_prefill_tokens), is_chained=joins
        )
        touched: dict[str, GenerateRequest] = {}
        for seq in decoding:
            self._decode(seq, touched)
        for seq in prefilling:
            if seq.num_pending_tokens == 0:
                self._on_prefilled(seq, touched)
        for request in touched.values():
            self._emit(request)
        self.num_steps += 1
        remaining_s = ends_at - self._clock()
        if remaining_s > 0:
            self._sleep(remaining_s)
        return self._take_events()

    def _admit(self) -> tuple[list[Sequence], int, bool]:
        """Sequences whose prompt KV this step computes (in arrival order, within the prefill
        chunk and max_num_seqs), how many prompt tokens that is (a sequence with only its next
        token to compute decodes: none), and whether every waiting sequence was such a decode
        (admitted or not)."""
        budget = self.config.prefill_chunk_size
        admitted: list[Sequence] = []
        num_prefill_tokens = 0
        joins = all(seq.decodes_next for seq in self._waiting)
        for seq in self._waiting:
            if budget == 0 or len(self._running) + len(admitted) >= self.config.max_num_seqs:
                break
            if not self.pages.grow(seq.block_table, seq.num_tokens):
                break  # first come, first served: later ones wait too
            num_tokens = min(seq.num_pending_tokens, budget)
            if not seq.decodes_next:
                num_prefill_tokens += num_tokens
            seq.num_computed_tokens += num_tokens
            seq.status = SeqStatus.RUNNING
            budget -= num_tokens
            admitted.append(seq)
        for seq in admitted:
            if seq.num_pending_tokens == 0:
                self._waiting.remove(seq)
        return admitted, num_prefill_tokens, joins

    def _on_prefilled(self, seq: Sequence, touched: dict[str, GenerateRequest]) -> None:
        if seq.kind is SeqKind.SEND:
            seq.status = SeqStatus.PARKED
            self._sends[seq.request_id].is_ready = True
            self._events.append(SendReady(seq.request_id))
            first = self._first_samples.get(seq.request_id)
            if first is not None and first[0] is seq:
                del self._first_samples[seq.request_id]
                self._draw_first(first[1])
            return
        request = self._requests[seq.request_id]
        if request.is_forked:  # a continuation: its choices are all here already
            self._running.append(seq)
            self._sample(request, request.choices[seq.choice_index], touched)
            return
        for index in range(1, request.sampling.n):  # n > 1: the other choices fork here
            child = self._new_seq(seq.request_id, list(seq.token_ids), SeqKind.GENERATE)
            child.choice_index, child.status = index, SeqStatus.RUNNING
            child.num_computed_tokens = child.num_cached_tokens = seq.num_computed_tokens
            child.is_disaggregated = seq.is_disaggregated
            request.choices.append(self._new_choice(index, child, request.sampling))
            self.pages.grow(child.block_table, child.num_tokens)
            self._running.append(child)
        self._running.append(seq)
        for choice in request.choices:  # the parent first, as LLMEngine samples them
            self._sample(request, choice, touched)

    def _draw_first(self, request: GenerateRequest) -> None:
        for choice in request.choices:
            sampled = self._streams.pop(choice).next()
            choice.seq.token_ids.append(sampled.token_id)
            add_token(request, choice, sampled, self.tokenizer)
        output = take_output(request, self.packs_outputs)
        assert output is not None  # every choice has a token
        self._events.append(FirstTokens(request.request_id, output, (b"",) * len(request.choices)))

    def _decode(self, seq: Sequence, touched: dict[str, GenerateRequest]) -> None:
        request = self._requests.get(seq.request_id)
        if request is None or seq.is_finished:
            return
        self._sample(request, request.choices[seq.choice_index], touched)

    def _sample(self, request: GenerateRequest, choice: Choice, touched: dict[str, GenerateRequest]) -> None:
        seq = choice.seq
        touched[request.request_id] = request
        if not self.pages.grow(seq.block_table, seq.num_tokens + 1):
            self._drop_seq(seq)
            finish_choice(choice, FinishReason.LENGTH)  # out of KV pages, as LLMEngine does
            return
        sampled = self._streams[choice].next()
        seq.token_ids.append(sampled.token_id)
        seq.num_computed_tokens = seq.num_tokens - 1  # the new token's KV comes next step
        add_token(request, choice, sampled, self.tokenizer)
        if choice.is_finished:
            self._drop_seq(seq)

    def _emit(self, request: GenerateRequest) -> None:
        output = take_output(request, self.packs_outputs)
        if output is not None:
            self._events.append(output)
        if request.is_finished:
            self._requests.pop(request.request_id, None)
            for choice in request.choices:
                self._streams.pop(choice, None)

    def _take_events(self) -> list[EngineEvent | PackedOutput]:
        events, self._events = self._events, []
        return events

    # ---- sequences ----
    def _drop_seq(self, seq: Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._waiting:
            self._waiting.remove(seq)
        self.pages.release(seq.block_table)
        seq.status = SeqStatus.FINISHED

    def _new_seq(self, request_id: str, ids: list[int], kind: SeqKind) -> Sequence:
        return Sequence(self._next_seq_id_now(), request_id, ids, len(ids), kind)

    def _new_choice(self, index: int, seq: Sequence, sampling: SamplingParams) -> Choice:
        # No torch generator: the synthetic tokens come from TokenStream.
        choice = Choice(
            index=index, seq=seq, generator=cast(Any, None),
            decoder=self.tokenizer.incremental_decoder(),
        )
        self._streams[choice] = TokenStream(seq.token_ids[: seq.num_prompt_tokens], sampling, index)
        return choice

    # ---- status ----
    def status(self) -> EngineStatus:
        constant = constant_status(self.model_id, self.kv_layout.model_fingerprint, self.kv_layout,
                                   self.num_pages, self.max_context_length)
        return status_from_fields(constant, self.status_fields())

    def status_fields(self) -> StatusFields:
        running = {s.request_id for s in self._running}
        waiting = {s.request_id for s in self._waiting} - running
        return (len(running), len(waiting), self.num_free_pages, len(self._reservations),
                (0, 0, 0, 0, 0), None)
