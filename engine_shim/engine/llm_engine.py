"""The synchronous engine core: add_request / step / abort and start_generate, over paged
KV with continuous batching. MicroServing's receive and send half (prep_recv, import_kv,
remote_send, export_kv) lives in disaggregation.py and is mixed in. Not thread-safe: one
caller (the async adapter's engine thread, or a test) drives it.

Every public call validates its input and raises a domain error (api.py) before it changes
any state, so a bad call never harms other requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass
from pathlib import Path

import torch

from microserving.tokenizer import Tokenizer

from . import validation
from .api import (
    AlreadyExistsError,
    EngineCounters,
    EngineStatus,
    FailedPreconditionError,
    FinishReason,
    GenerateOutput,
    KVLayout,
    PreemptedError,
    RequestAbortedError,
    ResourceExhaustedError,
    SamplingParams,
)
from .block_manager import BlockManager, num_pages_for, slots_for_positions
from .config import MODEL_PRESETS, EngineConfig, ModelConfig, resolve_model_config
from .cuda_graphs import Feed
from .disaggregation import (
    DisaggregationOps,
    EngineEvent,
    Fence,
    Reservation,
    SendFailed,
    SendJob,
    SendReady,
)
from .kv_cache import KVCache
from .model_runner import ModelRunner, RunResult
from .request import (
    Choice,
    GenerateRequest,
    add_token,
    feed_deferred_text,
    finish_choice,
    take_delta,
)
from .sampler import SampledToken, choice_seed, is_plain_greedy, sample
from .scheduler import ScheduledSeq, Scheduler
from .sequence import SeqKind, SeqStatus, Sequence
from .weights import DTYPES, build_model, model_fingerprint

logger = logging.getLogger(__name__)


@dataclass
class _Launched:
    batch: list[ScheduledSeq]
    result: RunResult
    # Launched by _launch_chained: its positions count as computed only once the feeding
    # step's tokens are on the host (_settle_chained).
    chained: bool = False


class LLMEngine(DisaggregationOps):
    """The synchronous engine: generation here, the MicroServing send/receive half in
    DisaggregationOps (disaggregation.py)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config: ModelConfig = resolve_model_config(config.model)
        model_dir = None if config.model in MODEL_PRESETS else Path(config.model)
        self.tokenizer = Tokenizer.from_model(config.model)
        self.model = build_model(
            self.model_config, model_dir, config.seed, config.device, config.dtype
        )
        self.page_size = config.page_size
        self.num_pages = config.num_pages or self._pages_from_budget()
        self.kv_cache = KVCache(
            self.model_config, self.num_pages, self.page_size, DTYPES[config.dtype], config.device
        )
        self.block_manager = BlockManager(self.num_pages, self.page_size, config.enable_prefix_cache)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.prefill_chunk_size,
            prefill_hold_s=config.prefill_hold_ms / 1e3,
        )
        self.runner = ModelRunner(self.model, self.model_config, self.kv_cache, self.page_size)
        self.fingerprint = model_fingerprint(self.model_config, model_dir, config.seed, config.dtype)
        self.model_id = config.model if model_dir is None else model_dir.name
        self.max_context_length = min(
            config.max_context_length or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self._requests: dict[str, GenerateRequest] = {}
        self._sends: dict[str, SendJob] = {}
        self._reservations: dict[str, Reservation] = {}
        self._fences: list[Fence] = []
        self._events: list[EngineEvent] = []
        # Step pipelining (EngineConfig.overlap_steps): the batch whose forward is running on
        # the device, and the requests whose text waits to be decoded while it runs.
        self.overlap_steps = (
            config.overlap_steps if config.overlap_steps is not None
            else torch.device(config.device).type == "cuda"
        )
        self.chain_decode = self.overlap_steps if config.chain_decode is None else config.chain_decode
        self._in_flight: _Launched | None = None
        self.num_chained_steps = 0  # decode steps launched by _launch_chained (for tests, benches)
        self._deferred: dict[str, GenerateRequest] = {}
        self._next_seq_id = 0
        self.num_steps = 0
        self.step_time_s = 0.0  # summed wall time of step()
        self.num_sampled_tokens = 0
        self._rng = torch.Generator().manual_seed(config.seed)

    # ---- facts ----
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(
            model_fingerprint=self.fingerprint,
            dtype=self.config.dtype,
            num_layers=self.model_config.num_layers,
            num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            page_size=self.page_size,
        )

    @property
    def has_work(self) -> bool:
        return (
            bool(self._events) or self.scheduler.has_work
            or self._in_flight is not None or bool(self._deferred)
        )

    def is_active(self, request_id: str) -> bool:
        return (
            request_id in self._requests
            or request_id in self._sends
            or request_id in self._reservations
        )

    def _pages_from_budget(self) -> int:
        per_page = KVCache.bytes_per_token(self.model_config, DTYPES[self.config.dtype]) * self.page_size
        return max(1, self.config.kv_cache_memory_mb * (1 << 20) // per_page)

    # ---- generate ----
    def add_request(
        self, request_id: str, token_ids: SequenceT[int], sampling: SamplingParams | None = None
    ) -> None:
        """A plain generate request: start_generate with begin=0 and no reservation."""
        self.start_generate(request_id, token_ids, 0, sampling or SamplingParams())

    def start_generate(
        self, request_id: str, token_ids: SequenceT[int], begin: int, sampling: SamplingParams
    ) -> None:
        request_id = validation.check_request_id(request_id)
        ids = validation.check_token_ids(token_ids, self.vocab_size)
        b = validation.check_start_generate_begin(begin, len(ids))
        max_tokens = validation.check_sampling(
            sampling, self.vocab_size, self.max_context_length, len(ids)
        )
        if request_id in self._requests or request_id in self._sends:
            raise AlreadyExistsError(f"request {request_id!r} is already active")
        self._check_fits_pool(len(ids) + 1)
        reservation = self._reservations.get(request_id)
        if reservation is None and b != 0:
            raise FailedPreconditionError(
                f"start_generate without prep_recv: begin={b} needs KV that this engine lacks"
            )
        if reservation is not None:
            self._check_reservation_covers(reservation, ids, b)
        seq = self._new_seq(request_id, ids, len(ids), SeqKind.GENERATE)
        seq.cache_salt = sampling.cache_salt
        if reservation is not None:
            del self._reservations[request_id]
            seq.block_table = reservation.block_table
            # KV below max(begin, matched) is present; recomputing cached pages would write
            # into pages other sequences share.
            seq.num_computed_tokens = max(b, reservation.prefix_matched_length)
            seq.num_cached_tokens = reservation.prefix_matched_length
            seq.num_transferred_tokens = seq.num_computed_tokens - seq.num_cached_tokens
            seq.is_disaggregated = True
        request = GenerateRequest(
            request_id=request_id,
            sampling=sampling,
            max_tokens=max_tokens,
            num_prompt_tokens=len(ids),
            stop_token_ids=self._stop_token_ids(sampling),
            choices=[self._new_choice(0, seq, sampling)],
        )
        self._requests[request_id] = request
        self.scheduler.add(seq)

    # ---- abort ----
    def abort(self, request_id: str) -> bool:
        """Free everything the request holds; True if it was active."""
        self._finish_deferred_text()  # the request's earlier deltas go out first
        found = False
        request = self._requests.pop(request_id, None)
        if request is not None:
            found = True
            for choice in request.choices:
                if not choice.is_finished:
                    self._drop_seq(choice.seq)
                    finish_choice(choice, FinishReason.ABORT)
            self._events.append(self._output(request, finished=True))
        job = self._sends.pop(request_id, None)
        if job is not None:
            found = True
            self._drop_seq(job.seq)
            self._events.append(SendFailed(request_id, RequestAbortedError(f"{request_id!r} aborted")))
        reservation = self._reservations.pop(request_id, None)
        if reservation is not None:
            found = True
            self._release_reservation(reservation)
        return found

    # ---- the step ----
    def step(self) -> list[EngineEvent]:
        """One engine step (`_step`), timed and counted for the engine's metrics."""
        started_s = time.perf_counter()
        events = self._step()
        self.step_time_s += time.perf_counter() - started_s
        self.num_steps += 1
        return events

    def _step(self) -> list[EngineEvent]:
        """One engine step. With overlap_steps, a step collects the tokens of the forward the
        previous step launched, schedules and launches the next forward, and decodes the
        collected tokens' text while the device runs it; the events of a forward are
        returned one call later than without (the order of each request's events is the
        same)."""
        self.reap_expired_reservations()
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            chained = self._launch_chained(previous) if self.overlap_steps and self.chain_decode else None
            self._collect(previous)
            if chained is not None:
                self._settle_chained(chained)
                self._in_flight = chained
                self._finish_deferred_text()  # runs while the device computes the chained step
                events, self._events = self._events, []
                return events
        out = self.scheduler.schedule()
        if out.preempted_aborted or out.out_of_pages:
            self._finish_deferred_text()  # their finishing events come after earlier deltas
        for seq in out.preempted_aborted:
            self._on_preempted(seq)
        for seq in out.ready_sends:
            self._on_send_ready(seq)
        for seq in out.out_of_pages:
            self._on_out_of_pages(seq)
        launched = self._launch(out.scheduled) if out.scheduled else None
        if launched is not None and self.overlap_steps:
            self._in_flight = launched
        self._finish_deferred_text()  # runs while the device computes the launched forward
        if launched is not None and not self.overlap_steps:
            self._collect(launched)
        events, self._events = self._events, []
        return events

    def _launch(self, batch: list[ScheduledSeq]) -> _Launched:
        needs_logits = [
            s.seq.kind is SeqKind.GENERATE and s.num_tokens == s.seq.num_pending_tokens for s in batch
        ]
        # asynchronous on CUDA; a pure decode step keeps its argmax on the device to feed a
        # chained step
        result = self.runner.run(batch, needs_logits, keep_argmax=self.chain_decode)
        for item in batch:
            self.scheduler.on_computed(item)
            if item.seq.kind is SeqKind.SEND and item.seq.num_pending_tokens == 0:
                self.scheduler.remove(item.seq)
                item.seq.status = SeqStatus.PARKED
                self._on_send_ready(item.seq)
        return _Launched(batch, result)

    def _launch_chained(self, previous: _Launched) -> _Launched | None:
        """The next decode step of `previous`'s sequences, launched before previous's tokens
        are read back: each row's input id is previous's argmax on the device. Only when that
        argmax is the token the host will append (every request plain greedy, n = 1, no stop
        strings, so no text decides a finish) and the step is exactly what schedule() would
        run after collecting: nothing waits, every running sequence is one of previous's rows
        and none has a token pending. A sequence that finishes with previous's token wastes
        its row of this step (its KV write lands in its own pages, released after this launch
        and reused only by later work on the same stream)."""
        result = previous.result
        if result.argmax is None or self.scheduler.waiting or not self.scheduler.running:
            return None
        rows: list[int] = []
        batch: list[ScheduledSeq] = []
        for row, index in enumerate(result.sampled_index):
            seq = previous.batch[index].seq
            if seq.is_finished:
                continue  # ended by an earlier step's token: no row this time
            request = self._requests.get(seq.request_id)
            if (
                request is None or seq.status is not SeqStatus.RUNNING or seq.num_pending_tokens != 0
                or seq.kind is not SeqKind.GENERATE or not self._chains(request)
            ):
                return None
            rows.append(row)
            batch.append(ScheduledSeq(seq, 1))
        if len(batch) != len(self.scheduler.running):
            return None  # another sequence (a prefill, a send job) needs schedule()
        for item in batch:  # the page of each next position; none free: schedule() decides
            if not self.scheduler.ensure_pages(item.seq, 1):
                return None
        result = self.runner.run(batch, [True] * len(batch), feed=Feed(result.argmax, rows))
        self.num_chained_steps += 1
        return _Launched(batch, result, chained=True)

    def _chains(self, request: GenerateRequest) -> bool:
        sampling = request.sampling
        return sampling.n == 1 and not sampling.stop and is_plain_greedy(sampling)

    def _settle_chained(self, launched: _Launched) -> None:
        # The feeding step's tokens are appended now; the chained positions hold their KV.
        for item in launched.batch:
            if not item.seq.is_finished:
                self.scheduler.on_computed(item)

    def _collect(self, launched: _Launched) -> None:
        """Sample the launched forward's rows (waiting for the device) and emit, or defer the
        text of, every request that got a token."""
        batch, result = launched.batch, launched.result
        rows: list[tuple[int, GenerateRequest, Sequence]] = []
        for row, index in enumerate(result.sampled_index):
            seq = batch[index].seq
            request = self._requests.get(seq.request_id)
            # Aborted (or aborted and started again under its id) since the launch.
            if request is None or seq.is_finished or request.choices[seq.choice_index].seq is not seq:
                continue
            rows.append((row, request, seq))
        plain = [True] * len(result.sampled_index)
        for row, request, _ in rows:
            plain[row] = is_plain_greedy(request.sampling)
        result.prepare(plain)
        self.num_sampled_tokens += len(rows)
        touched: dict[str, GenerateRequest] = {}
        for row, request, seq in rows:
            touched[request.request_id] = request
            for choice in self._choices_sampling_now(request, seq):
                self._sample_into(request, choice, result, row)
        for request in touched.values():
            if self._defers_text(request):
                self._deferred[request.request_id] = request
            else:
                self._emit(request)

    def _defers_text(self, request: GenerateRequest) -> bool:
        # Stop strings end a choice by its text, which must be known before the next
        # schedule; n > 1 forks choices on their first token.
        return self.overlap_steps and not request.sampling.stop and request.sampling.n == 1

    def _finish_deferred_text(self) -> None:
        deferred, self._deferred = self._deferred, {}
        for request in deferred.values():
            for choice in request.choices:
                feed_deferred_text(choice)
            self._emit(request)

    def _choices_sampling_now(self, request: GenerateRequest, seq: Sequence) -> list[Choice]:
        choice = request.choices[seq.choice_index]
        if request.is_forked or request.sampling.n == 1:
            request.is_forked = True
            return [choice]
        request.is_forked = True
        return [choice, *self._fork(request, choice)]

    def _fork(self, request: GenerateRequest, parent: Choice) -> list[Choice]:
        """n > 1: the other choices share the parent's full prompt pages (ref counted) and get
        a copy of its partial last page; each then samples from the same logits."""
        children: list[Choice] = []
        seq = parent.seq
        num_full = seq.num_computed_tokens // self.page_size
        for index in range(1, request.sampling.n):
            child = self._new_seq(request.request_id, list(seq.token_ids), seq.num_prompt_tokens, SeqKind.GENERATE)
            child.choice_index, child.num_cached_tokens = index, seq.num_cached_tokens
            child.num_transferred_tokens, child.cache_salt = seq.num_transferred_tokens, seq.cache_salt
            child.is_disaggregated = seq.is_disaggregated
            has_partial = seq.num_computed_tokens % self.page_size != 0
            if self.block_manager.can_allocate(int(has_partial)):
                shared = seq.block_table[:num_full]
                self.block_manager.share(shared)
                child.block_table = list(shared)
                if has_partial:
                    child.block_table += self.block_manager.allocate(1)
                    begin = num_full * self.page_size
                    self.kv_cache.copy_slots(
                        slots_for_positions(seq.block_table, self.page_size, begin, seq.num_computed_tokens),
                        slots_for_positions(child.block_table, self.page_size, begin, seq.num_computed_tokens),
                    )
                child.num_computed_tokens = seq.num_computed_tokens
                self.scheduler.add_running(child)
            else:
                self.scheduler.add(child)  # no page for the copy: recompute the prompt later
            choice = self._new_choice(index, child, request.sampling)
            request.choices.append(choice)
            children.append(choice)
        return children

    def _sample_into(
        self, request: GenerateRequest, choice: Choice, result: RunResult, row: int
    ) -> None:
        seq = choice.seq
        if seq.num_pending_tokens != 0:
            return  # a child that must recompute its prompt samples when it gets there
        greedy = result.greedy_token(row)
        if greedy is not None:
            sampled = SampledToken(greedy)
        else:
            logits = result.host_logits(row)
            sampled = sample(logits, request.sampling, seq.output_token_ids, choice.generator)
        seq.token_ids.append(sampled.token_id)
        add_token(request, choice, sampled, self.tokenizer, defer_text=self._defers_text(request))
        if choice.is_finished:
            self._drop_seq(seq)

    def _emit(self, request: GenerateRequest) -> None:
        finished = request.is_finished
        output = self._output(request, finished)
        if output.deltas or finished:
            self._events.append(output)
        if finished:
            self._requests.pop(request.request_id, None)

    def _output(self, request: GenerateRequest, finished: bool) -> GenerateOutput:
        deltas = [take_delta(c, request.sampling.stop) for c in request.choices]
        return GenerateOutput(
            request_id=request.request_id,
            deltas=tuple(d for d in deltas if d is not None),
            usage=request.usage() if finished else None,
        )

    def _on_preempted(self, seq: Sequence) -> None:
        seq.block_table = []  # the scheduler released the pages
        if seq.kind is SeqKind.SEND:
            self._sends.pop(seq.request_id, None)
            self._events.append(SendFailed(seq.request_id, PreemptedError("remote_send preempted")))
            return
        request = self._requests[seq.request_id]
        finish_choice(request.choices[seq.choice_index], FinishReason.PREEMPT)
        self._finish_siblings_if_needed(request)
        self._emit(request)

    def _finish_siblings_if_needed(self, request: GenerateRequest) -> None:
        # A request of n choices is one unit for the router: once one is preempted, the flow
        # re-runs, so the others stop too.
        for choice in request.choices:
            if not choice.is_finished:
                self._drop_seq(choice.seq)
                finish_choice(choice, FinishReason.PREEMPT)
        while len(request.choices) < request.sampling.n:
            request.choices.append(self._placeholder_choice(request, len(request.choices)))

    def _placeholder_choice(self, request: GenerateRequest, index: int) -> Choice:
        seq = self._new_seq(request.request_id, [], 0, SeqKind.GENERATE)
        seq.status = SeqStatus.FINISHED
        choice = self._new_choice(index, seq, request.sampling)
        finish_choice(choice, FinishReason.PREEMPT)
        return choice

    def _on_send_ready(self, seq: Sequence) -> None:
        job = self._sends[seq.request_id]
        job.is_ready = True
        self._events.append(SendReady(seq.request_id))

    def _on_out_of_pages(self, seq: Sequence) -> None:
        self.scheduler.release(seq)
        seq.status = SeqStatus.FINISHED
        if seq.kind is SeqKind.SEND:
            self._sends.pop(seq.request_id, None)
            self._events.append(SendFailed(seq.request_id, ResourceExhaustedError("KV pool too small")))
            return
        request = self._requests[seq.request_id]
        finish_choice(request.choices[seq.choice_index], FinishReason.LENGTH)
        self._emit(request)

    # ---- helpers ----
    def _drop_seq(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.FINISHED and not seq.block_table:
            return
        self.scheduler.remove(seq)
        self.scheduler.release(seq)
        seq.status = SeqStatus.FINISHED

    def _new_seq(self, request_id: str, ids: list[int], num_prompt: int, kind: SeqKind) -> Sequence:
        self._next_seq_id += 1
        return Sequence(self._next_seq_id, request_id, ids, num_prompt, kind)

    def _new_choice(self, index: int, seq: Sequence, sampling: SamplingParams) -> Choice:
        if sampling.seed is not None:
            seed = choice_seed(sampling.seed, index)
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng).item())
        return Choice(
            index=index,
            seq=seq,
            generator=torch.Generator().manual_seed(seed),
            decoder=self.tokenizer.incremental_decoder(),
        )

    def _stop_token_ids(self, sampling: SamplingParams) -> frozenset[int]:
        ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            ids.update(self.tokenizer.eos_token_ids)
        return frozenset(ids)

    def _check_fits_pool(self, num_tokens: int) -> None:
        if num_pages_for(num_tokens, self.page_size) > self.num_pages:
            raise ResourceExhaustedError(
                f"{num_tokens} tokens need more KV pages than the pool holds ({self.num_pages})"
            )

    # ---- status ----
    def status(self) -> EngineStatus:
        running = {s.request_id for s in self.scheduler.running}
        waiting = {s.request_id for s in self.scheduler.waiting} - running
        return EngineStatus(
            model_id=self.model_id,
            model_fingerprint=self.fingerprint,
            kv_layout=self.kv_layout,
            num_running_requests=len(running),
            num_waiting_requests=len(waiting),
            num_free_pages=self.block_manager.num_free_pages,
            num_total_pages=self.num_pages,
            num_reserved_requests=len(self._reservations),
            max_context_length=self.max_context_length,
            prefix_cache=self.block_manager.prefix_cache_stats(),
            counters=EngineCounters(
                num_steps=self.num_steps, step_time_s=self.step_time_s,
                num_sampled_tokens=self.num_sampled_tokens,
                num_preemptions=self.scheduler.num_preemptions,
                num_reserved_pages=sum(len(r.block_table) for r in self._reservations.values()),
            ),
        )

    # ---- conveniences for tests and benchmarks ----
    def run_until_done(self, max_steps: int = 100_000) -> dict[str, list[GenerateOutput]]:
        outputs: dict[str, list[GenerateOutput]] = {}
        for _ in range(max_steps):
            if not self.has_work:
                return outputs
            for event in self.step():
                if isinstance(event, GenerateOutput):
                    outputs.setdefault(event.request_id, []).append(event)
        raise RuntimeError("engine did not finish within max_steps")

    @torch.inference_mode()
    def warmup(self) -> None:
        """One forward pass over a scratch page (outside any request) so the first real
        request does not pay for lazy initialisation."""
        if not self.block_manager.can_allocate(1):
            return
        page = self.block_manager.allocate(1)
        seq = Sequence(0, "__warmup__", [0, 1], 2, SeqKind.GENERATE, block_table=page)
        self.runner.run([ScheduledSeq(seq, 2)], [True])
        self.block_manager.release(page)
        if self.config.cuda_graphs:
            self.runner.capture_cuda_graphs(self.config.max_num_seqs, self.max_context_length)
