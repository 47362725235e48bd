"""Continuous batching: which sequences compute how many tokens this step.

Every running sequence that is decoding computes its one pending token each step; prompt
tokens (prefill, possibly in chunks) share a per-step budget of `prefill_chunk_size`. When a
sequence needs a page and none is free, the newest other running sequence is preempted:
recomputed later, or aborted if it is part of a disaggregated flow. Plain Python, no torch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .block_manager import BlockManager, num_pages_for
from .sequence import SeqKind, SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # computes positions [num_computed_tokens, num_computed_tokens + n)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # Preempted sequences of disaggregated flows; their pages are already released.
    preempted_aborted: list[Sequence] = field(default_factory=list)
    # Send jobs whose whole window came from the prefix cache: ready with no compute.
    ready_sends: list[Sequence] = field(default_factory=list)
    # Sequences that cannot grow even with the whole pool to themselves.
    out_of_pages: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        prefill_chunk_size: int,
        prefill_hold_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`prefill_hold_s`: while sequences decode, a prompt waits up to this long for more
        prompts to share its prefill step (see `_holds_prefill`)."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_size = prefill_chunk_size
        self.prefill_hold_s = prefill_hold_s
        self._clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        seq.waiting_since_s = self._clock()
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one (n > 1): it already holds its pages."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finish, abort, parked send job); pages stay."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's pages, offering its computed full pages to the prefix cache."""
        self.block_manager.release(seq.block_table, seq.token_ids, seq.num_computed_tokens, seq.cache_salt)
        seq.block_table = []

    def on_computed(self, scheduled: ScheduledSeq) -> None:
        scheduled.seq.num_computed_tokens += scheduled.num_tokens

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.prefill_chunk_size
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            budget = self._schedule_running(seq, budget, out)
        self._admit_waiting(budget, out)
        return out

    def _schedule_running(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        num_tokens = seq.num_pending_tokens
        if num_tokens > 1:
            num_tokens = min(num_tokens, budget)
            if num_tokens == 0:
                return budget
        scheduled_seqs: set[int] | None = None  # built only when pages run out (O(B) each)
        while not self._ensure_pages(seq, num_tokens):
            if scheduled_seqs is None:
                scheduled_seqs = {id(s.seq) for s in out.scheduled}
            victim = self._pick_victim(exclude=seq, scheduled=scheduled_seqs)
            if victim is None:
                if out.scheduled or self._fits_the_pool(seq, num_tokens):
                    # Wait for the others to finish, or for pages held outside the running
                    # sequences (a PrepRecv reservation, a send job, a fence) to come back.
                    self._preempt(seq, out)
                else:
                    self.running.remove(seq)
                    out.out_of_pages.append(seq)
                return budget
            self._preempt(victim, out)
        out.scheduled.append(ScheduledSeq(seq, num_tokens))
        return budget - num_tokens if seq.num_pending_tokens > 1 else budget

    def _holds_prefill(self, budget: int, out: SchedulerOutput) -> bool:
        """Whether new prompts wait this step. A step that prefills beside decodes runs the
        model eagerly (no CUDA graph: its shape is new), which costs the host several times a
        decode step; when prompts arrive one or two a step, as they do from a network, most
        steps would. Held up to `prefill_hold_s` from the oldest one's arrival, they share
        one such step. Never held: when nothing decodes (an idle engine answers at once),
        when this step prefills anyway, when a full chunk of prompt tokens waits, or for a
        sequence whose KV came from elsewhere (one pending token, or two for a continuation:
        a decode)."""
        first = self.waiting[0]
        # A continuation (its first output tokens came from the engine that computed the
        # prompt) computes the prompt's last position and its token: a decode too.
        if not self.prefill_hold_s or not out.scheduled or first.num_pending_tokens <= first.num_output_tokens + 1:
            return False
        if any(item.num_tokens > 1 for item in out.scheduled):
            return False
        if self._clock() - self.waiting[0].waiting_since_s >= self.prefill_hold_s:
            return False
        waiting_tokens = 0
        for seq in self.waiting:
            waiting_tokens += seq.num_pending_tokens
            if waiting_tokens >= budget:
                return False
        return len(self.running) + len(self.waiting) < self.max_num_seqs

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        if self.waiting and self._holds_prefill(budget, out):
            return
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            acquired = self._match_prefix(seq)
            num_tokens = min(seq.num_pending_tokens, budget)
            if seq.num_pending_tokens == 0 and seq.kind is SeqKind.SEND:
                self._record_admission(seq)
                self.waiting.popleft()
                seq.status = SeqStatus.PARKED
                out.ready_sends.append(seq)
                continue
            if num_tokens == 0 or not self._ensure_pages(seq, num_tokens):
                if acquired:  # give the matched pages back; the next try matches again
                    self.block_manager.release(seq.block_table)
                    seq.block_table, seq.num_computed_tokens = [], 0
                elif num_tokens and seq.is_disaggregated and not self.running and not out.scheduled:
                    # It holds its reservation's pages and nothing running will free more:
                    # the pages it lacks are other reservations', whose sequences queue
                    # behind it. Preempted, it frees them (the router runs it again).
                    self.waiting.popleft()
                    self._preempt(seq, out)
                return
            self._record_admission(seq)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens

    def admit_decodes(self, seqs: list[Sequence]) -> None:
        """Waiting sequences that each compute one position, their pages ensured (a chained
        step's joiners, LLMEngine._chain_joiners), admitted in order as _admit_waiting admits."""
        for seq in seqs:
            self._record_admission(seq)
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _match_prefix(self, seq: Sequence) -> bool:
        if seq.block_table or seq.num_computed_tokens:
            return False  # it came with KV (a prep_recv reservation)
        pages = self.block_manager.acquire_prefix(seq.token_ids, seq.max_prefix_match_tokens, seq.cache_salt)
        seq.block_table = pages
        seq.num_computed_tokens = len(pages) * self.block_manager.page_size
        return True

    def _record_admission(self, seq: Sequence) -> None:
        if seq.is_admitted_once:
            return
        seq.is_admitted_once = True
        if not seq.num_cached_tokens and not seq.num_transferred_tokens:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.block_manager.record_prefix_query(seq.max_prefix_match_tokens, seq.num_computed_tokens)

    def ensure_pages(self, seq: Sequence, num_tokens: int) -> bool:
        """Pages for positions up to num_computed_tokens + num_tokens, if free ones remain."""
        return self._ensure_pages(seq, num_tokens)

    def _ensure_pages(self, seq: Sequence, num_tokens: int) -> bool:
        needed = num_pages_for(seq.num_computed_tokens + num_tokens, self.block_manager.page_size)
        missing = needed - len(seq.block_table)
        if missing <= 0:
            return True
        if not self.block_manager.can_allocate(missing):
            return False
        seq.block_table.extend(self.block_manager.allocate(
            missing, seq.block_table[-1] if seq.block_table else None))
        return True

    def _fits_the_pool(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the whole pool could hold `seq` after this step's tokens."""
        needed = num_pages_for(seq.num_computed_tokens + num_tokens, self.block_manager.page_size)
        return needed <= self.block_manager.num_total_pages

    def _pick_victim(self, exclude: Sequence, scheduled: set[int]) -> Sequence | None:
        for seq in reversed(self.running):
            if seq is not exclude and id(seq) not in scheduled:
                return seq
        return None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        if seq in self.running:
            self.running.remove(seq)
        self.release(seq)
        if seq.is_disaggregated:
            seq.status = SeqStatus.FINISHED
            out.preempted_aborted.append(seq)
            return
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
