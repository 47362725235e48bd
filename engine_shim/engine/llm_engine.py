"""The synchronous engine core: add_request / step / abort and start_generate, over paged
KV with continuous batching, and MicroServing's receive and send calls (prep_recv,
import_kv, remote_send, export_kv), whose reservations and send jobs a `Disaggregation`
(disaggregation.py) holds. Not thread-safe: one caller (the async adapter's engine thread,
or a test) drives it.

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
    Continuation,
    EngineStatus,
    FinishReason,
    GenerateOutput,
    KVChunk,
    KVLayout,
    PackedOutput,
    PreemptedError,
    PrepRecvResult,
    RequestAbortedError,
    ResourceExhaustedError,
    SamplingParams,
    StatusFields,
    constant_status,
    status_from_fields,
)
from .block_manager import BlockManager, Slots, num_pages_for, slots_for_positions
from .config import MODEL_PRESETS, EngineConfig, ModelConfig, resolve_model_config
from .cuda_graphs import Feed
from .disaggregation import Disaggregation, EngineEvent, FirstTokens, SendFailed, SendReady
from .kv_cache import KVCache
from .kv_waits import KVWaits
from .model_runner import ModelRunner, RunResult
from .request import (
    Choice,
    GenerateRequest,
    add_token,
    feed_deferred_text,
    finish_choice,
    first_token_request,
    fork_sequence,
    new_choice,
    replay_tokens,
    restore_sampler_state,
    sampler_state,
    stop_token_ids,
    take_output,
)
from .sampler import SampledToken, is_greedy, is_plain_greedy, sample
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
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


class LLMEngine:
    """The synchronous engine: generation, stepping and abort, and the MicroServing calls
    over its `disaggregation` state."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.cpu_threads and not config.device.startswith("cuda"):
            torch.set_num_threads(config.cpu_threads)
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
        self.runner = ModelRunner(
            self.model, self.model_config, self.kv_cache, self.page_size, config.paged_prefill
        )
        self.fingerprint = model_fingerprint(self.model_config, model_dir, config.seed, config.dtype)
        self.model_id = config.model if model_dir is None else model_dir.name
        self.max_context_length = min(
            config.max_context_length or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.disaggregation = Disaggregation(config, self.block_manager, self.kv_cache, self.kv_layout)
        self._requests: dict[str, GenerateRequest] = {}
        # Send jobs that sample the request's first tokens (remote_send's `first`): the job's
        # sequence and the request whose choices sample, until the job's last position's
        # logits are in.
        self._first_samples: dict[str, tuple[Sequence, GenerateRequest]] = {}
        self._events: list[EngineEvent | PackedOutput] = []
        self._kv_waits = KVWaits(lambda event: self._events.append(event))  # starts waiting for their reservation's KV
        # A core in a process of its own sends its outputs as plain tuples (api.PackedOutput):
        # step() then returns those in place of GenerateOutput.
        self.packs_outputs = False
        # Step pipelining (EngineConfig.overlap_steps): the batch whose forward is running on
        # the device, and the requests whose text waits to be decoded while it runs.
        self.overlap_steps = (
            config.overlap_steps if config.overlap_steps is not None
            else torch.device(config.device).type == "cuda"
        )
        self.chain_decode = self.overlap_steps if config.chain_decode is None else config.chain_decode
        self._in_flight: _Launched | None = None
        self.num_chained_steps = 0  # decode steps launched by _launch_chained (for tests, benches)
        self.num_chain_joins = 0  # waiting sequences those steps took (_chain_joiners)
        self._deferred: dict[str, GenerateRequest] = {}
        self._next_seq_id = 0
        self.num_steps = 0
        self.step_time_s = 0.0  # summed wall time of step()
        self.busy_time_s = 0.0  # summed wall time its loop worked, idle waits left out (core_loop)
        self.num_sampled_tokens = 0
        self._rng = torch.Generator().manual_seed(config.seed)
        # status()'s constant part; status_fields() gives the rest
        self._constant_status = constant_status(
            self.model_id, self.fingerprint, self.kv_layout, self.num_pages, self.max_context_length
        )

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
        return request_id in self._requests or self.disaggregation.is_active(request_id)

    def _is_generating_or_sending(self, request_id: str) -> bool:
        # A reservation of the same id is the one start_generate continues (or, on one
        # engine, the receive half of a flow whose send half is remote_send).
        return (request_id in self._requests or request_id in self.disaggregation.sends
                or request_id in self._kv_waits)

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
        self, request_id: str, token_ids: SequenceT[int], begin: int, sampling: SamplingParams,
        after_kv: bool = False, continuations: SequenceT[Continuation] = (),
    ) -> None:
        """Start generating from prompt[begin:]. `after_kv`: the request's reservation is
        still receiving its KV; the start waits here and runs in the turn the KV completes
        (finish_kv_write, or import_kv's last position), and fails (a StartFailed event) if
        the reservation ends first (kv_waits.py). `continuations`: the output began on the
        engine that sent the KV (remote_send's `first`): per choice, in index order, (index,
        output tokens so far, generator state); each choice goes on from prompt + its tokens."""
        request_id = validation.check_request_id(request_id)
        ids = validation.check_token_ids(token_ids, self.vocab_size)
        b = validation.check_start_generate_begin(begin, len(ids), continues=bool(continuations))
        max_tokens = validation.check_sampling(
            sampling, self.vocab_size, self.max_context_length, len(ids)
        )
        validation.check_continuations(continuations, sampling.n, self.vocab_size)
        if self._is_generating_or_sending(request_id):
            raise AlreadyExistsError(f"request {request_id!r} is already active")
        self._check_fits_pool(len(ids) + 1 + max((len(c[1]) for c in continuations), default=0))
        if after_kv and not self.disaggregation.is_filled(request_id, ids, b):
            self._kv_waits.wait(
                request_id, lambda: self.start_generate(request_id, ids, b, sampling, continuations=continuations))
            return
        reservation = self.disaggregation.take_reservation(request_id, ids, b)
        seq = self._new_seq(request_id, ids, len(ids), SeqKind.GENERATE)
        seq.cache_salt = sampling.cache_salt
        if reservation is not None:
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
            stop_token_ids=stop_token_ids(sampling, self.tokenizer.eos_token_ids),
            choices=[] if continuations else [self._new_choice(0, seq, sampling)],
        )
        self._requests[request_id] = request
        if continuations:
            self._continue(request, seq, continuations)
            return
        self.scheduler.add(seq)

    def _continue(self, request: GenerateRequest, seq: Sequence, continuations: SequenceT[Continuation]) -> None:
        """Every choice of the request from its continuation: the first choice that goes on
        takes `seq` (the reservation's pages), the others share its computed pages (or compute
        the prompt again where no page is free for the copy); choices that ended with the
        sender's tokens hold none. All ended: the request ends here, its pages freed."""
        request.is_forked = True  # its choices are all here; the first sample forks none
        holder: Sequence | None = None
        for index, token_ids, state in continuations:
            child = seq if holder is None else fork_sequence(holder, self._next_seq_id_now(), index)
            del child.token_ids[request.num_prompt_tokens:]
            child.choice_index = index
            choice = self._new_choice(index, child, request.sampling)
            if state:
                restore_sampler_state(choice, state)
            request.choices.append(choice)
            replay_tokens(request, choice, tuple(token_ids), self.tokenizer)
            if choice.is_finished:
                if child is seq:  # not yet a holder: a fresh sequence takes its place
                    choice.seq = Sequence(self._next_seq_id_now(), seq.request_id, list(child.token_ids),
                                          seq.num_prompt_tokens, status=SeqStatus.FINISHED)
                    seq.token_ids = seq.token_ids[:request.num_prompt_tokens]
                else:
                    child.status = SeqStatus.FINISHED
                continue
            if holder is None:
                holder = seq
            elif not self._share_pages(holder, child):
                child.num_computed_tokens = 0  # no page for the copy: compute the prompt here
            self.scheduler.add(child)
        if holder is None:  # every choice ended with the sender's tokens
            self.scheduler.release(seq)
            seq.status = SeqStatus.FINISHED
            self._emit(request)

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
            output = take_output(request, self.packs_outputs, ended=True)
            assert output is not None  # an ended request always has its last output
            self._events.append(output)
        self._drop_first_samples(request_id)
        job = self.disaggregation.pop_send(request_id)
        if job is not None:
            found = True
            self._drop_seq(job.seq)
            self._events.append(SendFailed(request_id, RequestAbortedError(f"{request_id!r} aborted")))
        self._kv_waits.ended(request_id)
        return self.disaggregation.release_reservation(request_id) or found

    # ---- MicroServing: receiving (prep_recv, KV in, then start_generate) ----
    def prep_recv(
        self,
        request_id: str,
        token_ids: SequenceT[int],
        end: int,
        sampling: SamplingParams | None = None,
        held: bool = False,
        whole_prompt: bool = False,
    ) -> PrepRecvResult:
        """Reserve pages for [0, end) of the prompt, to receive its KV. `held`: the
        reservation does not expire by itself; its owner ends it with expire_reservation (the
        shim, when it owns the TTL: a NIXL write's claim then needs no engine round trip).
        `whole_prompt`: end may be len(prompt), for a start that continues from the sender's
        first tokens (its first step then decodes the first token; the prefix cache never
        covers the last prompt position, which the sender always sends)."""
        request_id = validation.check_request_id(request_id)
        ids = validation.check_token_ids(token_ids, self.vocab_size)
        e = validation.check_prep_recv_end(end, len(ids), whole_prompt)
        if sampling is not None:
            validation.check_sampling(sampling, self.vocab_size, self.max_context_length, len(ids))
        if self.is_active(request_id):
            raise AlreadyExistsError(f"request {request_id!r} is already active")
        self._check_fits_pool(len(ids) + 1)
        return self.disaggregation.reserve(
            request_id, ids, e, sampling.cache_salt if sampling else "", held
        )

    def expire_reservation(self, request_id: str) -> bool:
        """The owner's TTL of a held reservation passed: free its pages (fenced, if a peer's
        write may still land); False where none is left (consumed or aborted before)."""
        self._kv_waits.ended(request_id)
        if not self.disaggregation.release_reservation(request_id):
            return False
        logger.info("prep_recv reservation %s expired unused; reclaiming", request_id)
        return True

    def import_kv(self, request_id: str, chunk: KVChunk) -> None:
        if self.disaggregation.import_kv(request_id, chunk):
            self._kv_waits.filled(request_id, self.abort)

    def begin_kv_write(self, request_id: str, write_ends_at: float) -> None:
        """A peer is about to write [matched, end) of the reservation straight into its pages
        (a one-sided transfer-engine write) and writes nothing after `write_ends_at`
        (monotonic). Until finish_kv_write the reservation is held (it does not expire), and
        an abort fences the pages until then instead of freeing them: one engine call where
        a write was a hold and a begin."""
        self.disaggregation.begin_kv_write(request_id, write_ends_at)

    def finish_kv_write(self, request_id: str) -> None:
        """The peer's write landed (its notification arrived): [matched, end) is imported,
        and the reservation's TTL starts again, now, for the start_generate to come."""
        self.disaggregation.finish_kv_write(request_id)
        self._kv_waits.filled(request_id, self.abort)

    def cancel_kv_write(self, request_id: str, is_held: bool) -> None:
        """The peer gave up its write before it wrote anything (it says so; a sender that
        only vanishes is fenced by abort): no write is in flight, so an abort frees the
        pages at once again. The reservation stays, held (`is_held`: a sender's hold is
        still open) or with its TTL starting again."""
        self.disaggregation.cancel_kv_write(request_id, is_held)

    def send_is_ready(self, request_id: str) -> bool | None:
        """Whether the send's KV is computed and written to its pages (None: no such send).
        A transfer engine beside the core starts a write that waits for it once it is."""
        return self.disaggregation.send_is_ready(request_id)

    def describe_send(self, request_id: str) -> str:
        """Where a send stands, for a log line about one that is late: its job, its sequence
        in the scheduler, the pool."""
        job = self.disaggregation.sends.get(request_id)
        if job is None:
            return "no such send"
        seq, scheduler = job.seq, self.scheduler
        where = ("running" if seq in scheduler.running else
                 f"waiting {scheduler.waiting.index(seq)} of {len(scheduler.waiting)}"
                 if seq in scheduler.waiting else "in no queue")
        return (
            f"ready {job.is_ready}, device done {job.computed is None or job.computed.query()}, "
            f"{seq.status.name} {where}, computed {seq.num_computed_tokens} of {seq.num_tokens}, "
            f"{len(seq.block_table)} pages; {len(scheduler.running)} running, "
            f"{len(scheduler.waiting)} waiting, {self.block_manager.num_free_pages} pages free"
        )

    def hold_reservation(self, request_id: str, is_held: bool) -> None:
        """A KV push into the reservation has begun (held: it does not expire while the
        sender computes and streams, however long the sender's queue) or has ended (its
        TTL starts again, now, for the start_generate that should follow)."""
        self.disaggregation.hold_reservation(request_id, is_held)

    def next_deadline(self) -> float | None:
        """Monotonic time of the earliest finite reservation expiry (a held one has none) or
        fence end (the async loop sleeps until it)."""
        return self.disaggregation.next_deadline()

    def release_fences(self, now: float | None = None) -> None:
        self.disaggregation.release_fences(time.monotonic() if now is None else now)

    def reap_expired_reservations(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        self.disaggregation.release_fences(now)
        expired = self.disaggregation.expired_reservations(now)
        for request_id in expired:
            logger.info("prep_recv reservation %s expired unused; reclaiming", request_id)
            self.abort(request_id)
        return expired

    # ---- MicroServing: sending (remote_send, then export) ----
    def remote_send(
        self, request_id: str, token_ids: SequenceT[int], begin: int, end: int, cache_salt: str = "",
        first: SamplingParams | None = None,
    ) -> None:
        """Start computing KV of prompt[:end]; a SendReady event says [begin, end) can be
        exported with export_kv; release it with abort() once exported. `first`: the job
        computes the whole prompt and samples the first token of each of `first`'s choices
        from its last position, as a generate request would; a FirstTokens event carries
        them (after the SendReady, which does not wait for them)."""
        request_id = validation.check_request_id(request_id)
        ids = validation.check_token_ids(token_ids, self.vocab_size)
        b, e = validation.check_remote_send_window(begin, end, len(ids), samples_first=first is not None)
        max_tokens = 0
        if first is not None:
            max_tokens = validation.check_sampling(first, self.vocab_size, self.max_context_length, len(ids))
        if self._is_generating_or_sending(request_id):
            raise AlreadyExistsError(f"request {request_id!r} is already active")
        computed = e if first is None else len(ids)
        self._check_fits_pool(computed)
        seq = self._new_seq(request_id, ids[:computed], computed, SeqKind.SEND)
        seq.is_disaggregated = True
        seq.cache_salt = validation.check_cache_salt(cache_salt)
        if first is not None:
            seq.samples_last = True
            request = first_token_request(
                request_id, ids, first, max_tokens, stop_token_ids(first, self.tokenizer.eos_token_ids),
                self._next_seq_id_now, self._new_choice)
            self._first_samples[request_id] = (seq, request)
        self.disaggregation.add_send(seq, b, e)
        self.scheduler.add(seq)

    def export_windows(self, request_id: str) -> list[tuple[int, int]]:
        """(begin, num_tokens) chunks that cover a ready job's [begin, end)."""
        return self.disaggregation.export_windows(request_id)

    def export_kv(
        self, request_id: str, begin: int, num_tokens: int, out: torch.Tensor | None = None
    ) -> KVChunk:
        """KV of [begin, begin + num_tokens): a new CPU tensor, or written into `out` (of the
        chunk's shape and the pool's dtype, on any device)."""
        return self.disaggregation.export_kv(request_id, begin, num_tokens, out)

    def send_slots(self, request_id: str) -> Slots:
        """Slots of a ready job's [begin, end) in the pool, with the device's work on them
        finished: a transfer engine may read them from here until finish_remote_send."""
        return self.disaggregation.send_slots(request_id)

    def finish_remote_send(self, request_id: str) -> None:
        """Release a job after its KV went out: its computed pages go to the prefix cache."""
        job = self.disaggregation.pop_send(request_id)
        if job is not None:
            self._drop_seq(job.seq)

    # ---- the step ----
    def step(self) -> list[EngineEvent | PackedOutput]:
        """One engine step (`_step`), timed and counted for the engine's metrics."""
        started_s = time.perf_counter()
        events = self._step()
        self.step_time_s += time.perf_counter() - started_s
        self.num_steps += 1
        return events

    def _step(self) -> list[EngineEvent | PackedOutput]:
        """One engine step. With overlap_steps, a step collects the tokens of the forward the
        previous step launched, schedules and launches the next forward, and decodes the
        collected tokens' text while the device runs it; the events of a forward are
        returned one call later than without (the order of each request's events is the
        same)."""
        self.reap_expired_reservations()
        if self._in_flight is not None and self._collect_in_flight():
            return self._take_events()  # a chained step is running: nothing to schedule
        out = self.scheduler.schedule()
        self._end_unscheduled(out)
        # Choices of a preempted n > 1 request ended with it, scheduled or not.
        batch = [item for item in out.scheduled if not item.seq.is_finished]
        launched = self._launch(batch) if batch else None
        self._finish_launch(launched)
        return self._take_events()

    def _take_events(self) -> list[EngineEvent | PackedOutput]:
        events, self._events = self._events, []
        return events

    def _collect_in_flight(self) -> bool:
        """Collect the forward the previous step launched, first launching the decode step
        that follows it when it can chain; True if that chained step is now in flight."""
        previous, self._in_flight = self._in_flight, None
        assert previous is not None  # step() checked
        chained = self._launch_chained(previous) if self.overlap_steps and self.chain_decode else None
        self._collect(previous)
        if chained is None:
            return False
        self._settle_chained(chained)
        self._in_flight = chained
        self._finish_deferred_text()  # runs while the device computes the chained step
        return True

    def _end_unscheduled(self, out: SchedulerOutput) -> None:
        """Sequences the schedule ended or parked: preempted flows, cache-ready send jobs,
        sequences the pool cannot hold."""
        if out.preempted_aborted or out.out_of_pages:
            self._finish_deferred_text()  # their finishing events come after earlier deltas
        for seq in out.preempted_aborted:
            self._on_preempted(seq)
        for seq in out.ready_sends:
            self._on_send_ready(seq)
        for seq in out.out_of_pages:
            self._on_out_of_pages(seq)

    def _finish_launch(self, launched: _Launched | None) -> None:
        """Leave the launched forward in flight (overlap_steps) or collect it now; deferred
        text is decoded in between, while the device computes."""
        if launched is not None and self.overlap_steps:
            self._in_flight = launched
        self._finish_deferred_text()
        if launched is not None and not self.overlap_steps:
            self._collect(launched)

    def _launch(self, batch: list[ScheduledSeq]) -> _Launched:
        needs_logits = [s.seq.needs_logits_after and s.num_tokens == s.seq.num_pending_tokens for s in batch]
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
        and reused only by later work on the same stream). Waiting sequences that are decodes
        too (`_chain_joiners`: a continuation from a whole-prompt reservation) join the step
        as rows of their own, their input ids from the host, admitted as schedule() would."""
        result = previous.result
        joiners = self._chain_joiners()
        if result.argmax is None or joiners is None or not self.scheduler.running:
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
        joined = [ScheduledSeq(seq, 1) for seq in joiners]
        for item in [*batch, *joined]:  # the page of each next position; none free: schedule() decides
            if not self.scheduler.ensure_pages(item.seq, 1):
                return None
        self.scheduler.admit_decodes(joiners)
        batch += joined
        host_ids = [seq.token_ids[seq.num_computed_tokens] for seq in joiners]
        result = self.runner.run(batch, [True] * len(batch), feed=Feed(result.argmax, rows, host_ids))
        self.num_chained_steps += 1
        self.num_chain_joins += len(joiners)
        return _Launched(batch, result, chained=True)

    def _chain_joiners(self) -> list[Sequence] | None:
        """Every waiting sequence, where each is a decode schedule() would admit this step:
        a generate sequence whose KV is all in its pages but its next token's (one position
        to compute, that token on the host), which is what a continuation from a whole-prompt
        reservation starts as. None where one needs more (a prefill: the step is schedule()'s)
        or they would not all fit the step's sequences."""
        scheduler = self.scheduler
        waiting = scheduler.waiting
        if not waiting:
            return []
        if len(scheduler.running) + len(waiting) > scheduler.max_num_seqs or \
                len(waiting) > scheduler.prefill_chunk_size:
            return None
        for seq in waiting:
            if seq.kind is not SeqKind.GENERATE or not seq.decodes_next or not seq.block_table:
                return None
        return list(waiting)

    def _chains(self, request: GenerateRequest) -> bool:
        return request.can_defer_text and is_plain_greedy(request.sampling)

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
        firsts: list[tuple[int, GenerateRequest, Sequence]] = []
        for row, index in enumerate(result.sampled_index):
            seq = batch[index].seq
            if seq.kind is SeqKind.SEND:  # a send job that samples the first tokens
                held = self._first_samples.get(seq.request_id)
                if held is not None and held[0] is seq:  # not aborted since the launch
                    firsts.append((row, held[1], seq))
                continue
            request = self._requests.get(seq.request_id)
            # Aborted (or aborted and started again under its id) since the launch.
            if request is None or seq.is_finished or request.choices[seq.choice_index].seq is not seq:
                continue
            rows.append((row, request, seq))
        plain = [True] * len(result.sampled_index)
        for row, request, _ in (*rows, *firsts):
            plain[row] = is_plain_greedy(request.sampling)
        result.prepare(plain)
        self.num_sampled_tokens += len(rows) + len(firsts)
        for row, request, seq in firsts:
            del self._first_samples[request.request_id]
            self._sample_first(request, seq, result, row)
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
        return self.overlap_steps and request.can_defer_text

    def _finish_deferred_text(self) -> None:
        deferred, self._deferred = self._deferred, {}
        for request in deferred.values():
            for choice in request.choices:
                feed_deferred_text(choice)
            self._emit(request)

    def _choices_sampling_now(self, request: GenerateRequest, seq: Sequence) -> list[Choice]:
        parent = request.choices[seq.choice_index]
        return [parent, *(self._fork(request, parent, i) for i in request.take_fork_indices())]

    def _fork(self, request: GenerateRequest, parent: Choice, index: int) -> Choice:
        child = fork_sequence(parent.seq, self._next_seq_id_now(), index)
        if self._share_pages(parent.seq, child):
            self.scheduler.add_running(child)
        else:
            self.scheduler.add(child)  # no page for the copy: recompute the prompt later
        choice = self._new_choice(index, child, request.sampling)
        request.choices.append(choice)
        return choice

    def _share_pages(self, parent: Sequence, child: Sequence) -> bool:
        """The child shares the parent's full prompt pages (ref counted) and gets a copy of
        its partial last page; False if no page is free for that copy."""
        num_full = parent.num_computed_tokens // self.page_size
        has_partial = parent.num_computed_tokens % self.page_size != 0
        if not self.block_manager.can_allocate(int(has_partial)):
            return False
        shared = parent.block_table[:num_full]
        self.block_manager.share(shared)
        child.block_table = list(shared)
        if has_partial:
            child.block_table += self.block_manager.allocate(1)
            begin, end = num_full * self.page_size, parent.num_computed_tokens
            self.kv_cache.copy_slots(
                slots_for_positions(parent.block_table, self.page_size, begin, end),
                slots_for_positions(child.block_table, self.page_size, begin, end),
            )
        child.num_computed_tokens = parent.num_computed_tokens
        return True

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

    def _drop_first_samples(self, request_id: str) -> None:
        if self._first_samples.pop(request_id, None) is not None:
            self._events.append(FirstTokens(request_id, None, ()))

    def _sample_first(self, request: GenerateRequest, job: Sequence, result: RunResult, row: int) -> None:
        """A sampling send job's first tokens: each choice draws from the prompt's last
        position with its own generator, as a generate request's first step does."""
        greedy = result.greedy_token(row)
        logits = result.host_logits(row) if greedy is None else None
        states: list[bytes] = []
        for choice in request.choices:
            if greedy is not None:
                sampled = SampledToken(greedy)
            else:
                assert logits is not None
                sampled = sample(logits, request.sampling, (), choice.generator)
            choice.seq.num_cached_tokens = job.num_cached_tokens
            choice.seq.token_ids.append(sampled.token_id)
            add_token(request, choice, sampled, self.tokenizer)
            states.append(b"" if is_greedy(request.sampling) else sampler_state(choice))
        output = take_output(request, self.packs_outputs)
        assert output is not None  # every choice has a token
        self._events.append(FirstTokens(request.request_id, output, tuple(states)))

    def _emit(self, request: GenerateRequest) -> None:
        output = take_output(request, self.packs_outputs)
        if output is not None:
            self._events.append(output)
        if request.is_finished:
            self._requests.pop(request.request_id, None)

    def _on_preempted(self, seq: Sequence) -> None:
        seq.block_table = []  # the scheduler released the pages
        if seq.kind is SeqKind.SEND:
            self.disaggregation.pop_send(seq.request_id)
            self._drop_first_samples(seq.request_id)
            self._events.append(SendFailed(seq.request_id, PreemptedError("remote_send preempted")))
            return
        request = self._requests[seq.request_id]
        for ended in request.preempt(lambda index: self._placeholder_choice(request, index)):
            self._drop_seq(ended)
        self._emit(request)

    def _placeholder_choice(self, request: GenerateRequest, index: int) -> Choice:
        seq = self._new_seq(request.request_id, [], 0, SeqKind.GENERATE)
        seq.status = SeqStatus.FINISHED
        return self._new_choice(index, seq, request.sampling)

    def _on_send_ready(self, seq: Sequence) -> None:
        self.disaggregation.mark_ready(seq.request_id)
        self._events.append(SendReady(seq.request_id))

    def _on_out_of_pages(self, seq: Sequence) -> None:
        self.scheduler.release(seq)
        seq.status = SeqStatus.FINISHED
        if seq.kind is SeqKind.SEND:
            self.disaggregation.pop_send(seq.request_id)
            self._drop_first_samples(seq.request_id)
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

    def _next_seq_id_now(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def _new_seq(self, request_id: str, ids: list[int], num_prompt: int, kind: SeqKind) -> Sequence:
        return Sequence(self._next_seq_id_now(), request_id, ids, num_prompt, kind)

    def _new_choice(self, index: int, seq: Sequence, sampling: SamplingParams) -> Choice:
        return new_choice(index, seq, sampling, self.tokenizer, self._rng)

    def _check_fits_pool(self, num_tokens: int) -> None:
        if num_pages_for(num_tokens, self.page_size) > self.num_pages:
            raise ResourceExhaustedError(
                f"{num_tokens} tokens need more KV pages than the pool holds ({self.num_pages})"
            )

    # ---- the prefix cache ----
    def drop_prefix_cache(self) -> int:
        """Forget the cached prefixes no request holds (BlockManager.drop_cached_prefixes):
        the prompts that come next compute from scratch, as on a fresh engine; the pages
        dropped."""
        return self.block_manager.drop_cached_prefixes()

    # ---- status ----
    def status(self) -> EngineStatus:
        return status_from_fields(self._constant_status, self.status_fields())

    def status_fields(self) -> StatusFields:
        """What status() says that changes, as plain values (api.StatusFields)."""
        scheduler, prefix = self.scheduler, self.block_manager.prefix_cache_stats()
        running = {s.request_id for s in scheduler.running}
        waiting = {s.request_id for s in scheduler.waiting} - running
        reservations = self.disaggregation.reservations
        return (
            len(running), len(waiting), self.block_manager.num_free_pages, len(reservations),
            (prefix.num_queries, prefix.num_query_tokens, prefix.num_hit_tokens,
             prefix.num_cached_pages, prefix.num_evictable_pages),
            (self.num_steps, self.step_time_s, self.num_sampled_tokens, scheduler.num_preemptions,
             sum(len(r.block_table) for r in reservations.values()), self.busy_time_s),
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

    def run_remote_send(
        self, request_id: str, token_ids: SequenceT[int], begin: int, end: int
    ) -> list[KVChunk]:
        """remote_send + step until ready + export every chunk + release (other requests in
        the engine advance too)."""
        self.remote_send(request_id, token_ids, begin, end)
        while not self.disaggregation.sends[request_id].is_ready:
            failed = [e for e in self.step() if isinstance(e, SendFailed) and e.request_id == request_id]
            if failed:
                raise failed[0].error
        chunks = [self.export_kv(request_id, b, n) for b, n in self.export_windows(request_id)]
        self.finish_remote_send(request_id)
        return chunks

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
            self.runner.capture_cuda_graphs(
                self.config.max_num_seqs, self.max_context_length,
                self.config.prefill_chunk_size if self.config.mixed_cuda_graphs else None,
            )
