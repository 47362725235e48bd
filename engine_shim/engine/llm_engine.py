"""The synchronous engine core: add_request / step / abort plus MicroServing's prep_recv,
import_kv, remote_send (+ export_kv) and start_generate. Not thread-safe: one caller (the
async adapter's engine thread, or a test) drives it.

Every public call validates its input and raises a domain error (api.py) before it changes
any state, so a bad call never harms other requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from microserving.tokenizer import Tokenizer

from . import validation
from .api import (
    AlreadyExistsError,
    EngineStatus,
    FailedPreconditionError,
    FinishReason,
    GenerateOutput,
    InvalidRequestError,
    KVChunk,
    KVLayout,
    NotFoundError,
    PreemptedError,
    PrepRecvResult,
    RequestAbortedError,
    ResourceExhaustedError,
    SamplingParams,
)
from .block_manager import BlockManager, num_pages_for, slot_segments, slots_for_positions
from .config import MODEL_PRESETS, EngineConfig, ModelConfig, resolve_model_config
from .kv_cache import KVCache
from .model_runner import ModelRunner, RunResult
from .request import Choice, GenerateRequest, add_token, finish_choice, take_delta
from .sampler import SampledToken, is_plain_greedy, sample
from .scheduler import ScheduledSeq, Scheduler
from .sequence import SeqKind, SeqStatus, Sequence
from .weights import DTYPES, build_model, model_fingerprint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SendReady:
    """A remote_send job's KV of [begin, end) is computed and can be exported."""

    request_id: str


@dataclass(frozen=True)
class SendFailed:
    request_id: str
    error: Exception


EngineEvent = GenerateOutput | SendReady | SendFailed


@dataclass(eq=False)
class Reservation:
    """Pages prep_recv reserved for positions [0, end) of a prompt; [matched, end) await KV."""

    request_id: str
    token_ids: list[int]
    end: int
    prefix_matched_length: int
    block_table: list[int]
    expires_at: float
    imported: bytearray = field(default_factory=bytearray)  # 1 per position in [matched, end)


@dataclass(eq=False)
class SendJob:
    seq: Sequence
    begin: int
    end: int
    is_ready: bool = False


class LLMEngine:
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
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.prefill_chunk_size)
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
        self._events: list[EngineEvent] = []
        self._next_seq_id = 0
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
        return bool(self._events) or self.scheduler.has_work

    def is_active(self, request_id: str) -> bool:
        return (
            request_id in self._requests
            or request_id in self._sends
            or request_id in self._reservations
        )

    def next_deadline(self) -> float | None:
        """Monotonic time of the earliest reservation expiry (the async loop sleeps until it)."""
        return min((r.expires_at for r in self._reservations.values()), default=None)

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
        if reservation is not None:
            del self._reservations[request_id]
            seq.block_table = reservation.block_table
            # KV below max(begin, matched) is present; recomputing cached pages would write
            # into pages other sequences share.
            seq.num_computed_tokens = max(b, reservation.prefix_matched_length)
            seq.num_cached_tokens = seq.num_computed_tokens
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

    def _check_reservation_covers(self, reservation: Reservation, ids: list[int], begin: int) -> None:
        if ids[: reservation.end] != reservation.token_ids[: reservation.end]:
            raise FailedPreconditionError("start_generate prompt differs from the prep_recv prompt")
        if begin > reservation.end:
            raise FailedPreconditionError(
                f"begin={begin} is beyond the prep_recv window end={reservation.end}"
            )
        matched = reservation.prefix_matched_length
        if begin > matched and not all(reservation.imported[: begin - matched]):
            raise FailedPreconditionError(
                f"KV of positions [{matched}, {begin}) has not been fully imported"
            )

    # ---- prep_recv / import ----
    def prep_recv(
        self,
        request_id: str,
        token_ids: SequenceT[int],
        end: int,
        sampling: SamplingParams | None = None,
    ) -> PrepRecvResult:
        request_id = validation.check_request_id(request_id)
        ids = validation.check_token_ids(token_ids, self.vocab_size)
        e = validation.check_prep_recv_end(end, len(ids))
        if sampling is not None:
            validation.check_sampling(sampling, self.vocab_size, self.max_context_length, len(ids))
        if self.is_active(request_id):
            raise AlreadyExistsError(f"request {request_id!r} is already active")
        self._check_fits_pool(len(ids) + 1)
        pages = self.block_manager.acquire_prefix(ids, e)
        matched = len(pages) * self.page_size
        missing = num_pages_for(e, self.page_size) - len(pages)
        if not self.block_manager.can_allocate(missing):
            self.block_manager.release(pages)
            raise ResourceExhaustedError(f"not enough free KV pages to receive {e - matched} tokens")
        pages += self.block_manager.allocate(missing)
        self.block_manager.record_prefix_query(e, matched)
        self._reservations[request_id] = Reservation(
            request_id=request_id,
            token_ids=ids[:e],
            end=e,
            prefix_matched_length=matched,
            block_table=pages,
            expires_at=time.monotonic() + self.config.reservation_ttl_s,
            imported=bytearray(e - matched),
        )
        segments = slot_segments(slots_for_positions(pages, self.page_size, matched, e))
        flat = [len(segments)] + [x for segment in segments for x in segment]
        return PrepRecvResult(request_id, e, matched, tuple(flat))

    def import_kv(self, request_id: str, chunk: KVChunk) -> None:
        reservation = self._reservations.get(request_id)
        if reservation is None:
            raise NotFoundError(f"no prep_recv reservation for request {request_id!r}")
        begin, n = chunk.begin, chunk.num_tokens
        matched, end = reservation.prefix_matched_length, reservation.end
        if n < 1 or begin < matched or begin + n > end:
            raise InvalidRequestError(
                f"KV chunk [{begin}, {begin + n}) outside the reserved window [{matched}, {end})"
            )
        self._check_chunk_data(chunk.data, n)
        slots = slots_for_positions(reservation.block_table, self.page_size, begin, begin + n)
        self.kv_cache.import_slots(slots, cast(torch.Tensor, chunk.data))
        reservation.imported[begin - matched : begin - matched + n] = b"\x01" * n

    def _check_chunk_data(self, data: object, num_tokens: int) -> None:
        layout = self.kv_layout
        expected = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
        if not isinstance(data, torch.Tensor):
            raise InvalidRequestError("KV chunk data must be a tensor")
        if tuple(data.shape) != expected:
            raise InvalidRequestError(f"KV chunk shape {tuple(data.shape)}, expected {expected}")
        if data.dtype != DTYPES[self.config.dtype]:
            raise InvalidRequestError(f"KV chunk dtype {data.dtype}, expected {self.config.dtype}")

    # ---- remote_send ----
    def remote_send(self, request_id: str, token_ids: SequenceT[int], begin: int, end: int) -> None:
        """Start computing KV of prompt[:end]; a SendReady event says [begin, end) can be
        exported with export_kv; release it with abort() once exported."""
        request_id = validation.check_request_id(request_id)
        ids = validation.check_token_ids(token_ids, self.vocab_size)
        b, e = validation.check_remote_send_window(begin, end, len(ids))
        if request_id in self._sends or request_id in self._requests:
            raise AlreadyExistsError(f"request {request_id!r} is already active")
        self._check_fits_pool(e)
        seq = self._new_seq(request_id, ids[:e], e, SeqKind.SEND)
        seq.is_disaggregated = True
        self._sends[request_id] = SendJob(seq, b, e)
        self.scheduler.add(seq)

    def export_windows(self, request_id: str) -> list[tuple[int, int]]:
        """(begin, num_tokens) chunks that cover a ready job's [begin, end)."""
        job = self._ready_job(request_id)
        size = self.config.kv_export_chunk_tokens
        return [(p, min(size, job.end - p)) for p in range(job.begin, job.end, size)]

    def export_kv(self, request_id: str, begin: int, num_tokens: int) -> KVChunk:
        job = self._ready_job(request_id)
        if num_tokens < 1 or begin < job.begin or begin + num_tokens > job.end:
            raise InvalidRequestError(
                f"export window [{begin}, {begin + num_tokens}) outside [{job.begin}, {job.end})"
            )
        slots = slots_for_positions(job.seq.block_table, self.page_size, begin, begin + num_tokens)
        return KVChunk(begin=begin, num_tokens=num_tokens, data=self.kv_cache.export_slots(slots))

    def finish_remote_send(self, request_id: str) -> None:
        """Release a job after its KV went out: its computed pages go to the prefix cache."""
        job = self._sends.pop(request_id, None)
        if job is not None:
            self._drop_seq(job.seq)

    def _ready_job(self, request_id: str) -> SendJob:
        job = self._sends.get(request_id)
        if job is None:
            raise NotFoundError(f"no remote_send job for request {request_id!r}")
        if not job.is_ready:
            raise FailedPreconditionError(f"remote_send {request_id!r} is still computing")
        return job

    # ---- abort ----
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
            self._events.append(self._output(request, finished=True))
        job = self._sends.pop(request_id, None)
        if job is not None:
            found = True
            self._drop_seq(job.seq)
            self._events.append(SendFailed(request_id, RequestAbortedError(f"{request_id!r} aborted")))
        reservation = self._reservations.pop(request_id, None)
        if reservation is not None:
            found = True
            self.block_manager.release(reservation.block_table)
        return found

    def reap_expired_reservations(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        expired = [r.request_id for r in self._reservations.values() if r.expires_at <= now]
        for request_id in expired:
            logger.info("prep_recv reservation %s expired unused; reclaiming", request_id)
            self.abort(request_id)
        return expired

    # ---- the step ----
    def step(self) -> list[EngineEvent]:
        self.reap_expired_reservations()
        out = self.scheduler.schedule()
        for seq in out.preempted_aborted:
            self._on_preempted(seq)
        for seq in out.ready_sends:
            self._on_send_ready(seq)
        for seq in out.out_of_pages:
            self._on_out_of_pages(seq)
        if out.scheduled:
            self._run(out.scheduled)
        events, self._events = self._events, []
        return events

    def _run(self, batch: list[ScheduledSeq]) -> None:
        needs_logits = [
            s.seq.kind is SeqKind.GENERATE and s.num_tokens == s.seq.num_pending_tokens for s in batch
        ]
        result = self.runner.run(batch, needs_logits)
        for item in batch:
            self.scheduler.on_computed(item)
            if item.seq.kind is SeqKind.SEND and item.seq.num_pending_tokens == 0:
                self.scheduler.remove(item.seq)
                item.seq.status = SeqStatus.PARKED
                self._on_send_ready(item.seq)
        touched: dict[str, GenerateRequest] = {}
        requests = [self._requests[batch[index].seq.request_id] for index in result.sampled_index]
        result.prepare([is_plain_greedy(r.sampling) for r in requests])
        for row, (index, request) in enumerate(zip(result.sampled_index, requests, strict=True)):
            seq = batch[index].seq
            touched[request.request_id] = request
            for choice in self._choices_sampling_now(request, seq):
                self._sample_into(request, choice, result, row)
        for request in touched.values():
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
        add_token(request, choice, sampled, self.tokenizer)
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
            seed = sampling.seed + index
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
        while not self._sends[request_id].is_ready:
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
            self.runner.capture_cuda_graphs(self.config.max_num_seqs, self.max_context_length)
