"""One sequence of tokens whose KV the engine computes: a choice of a generate request, or
the prompt window of a remote_send job. Plain Python, no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"  # holds pages but is not scheduled (a remote_send job ready to export)
    FINISHED = "finished"


class SeqKind(enum.Enum):
    GENERATE = "generate"  # computes KV then samples a token each time it catches up
    SEND = "send"  # computes KV of its tokens only (remote_send); never samples


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    kind: SeqKind = SeqKind.GENERATE
    # Part of a disaggregated flow: preemption aborts it (FinishReason.PREEMPT) instead of
    # recomputing, because its KV came from (or goes to) another engine.
    is_disaggregated: bool = False
    choice_index: int = 0
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # positions [0, num_computed_tokens) hold valid KV
    num_cached_tokens: int = 0  # prompt tokens whose KV was a prefix-cache hit here
    num_transferred_tokens: int = 0  # prompt tokens whose KV another engine sent
    cache_salt: str = ""  # the prefix-cache scope of its pages (SamplingParams.cache_salt)
    # A send job that also samples the request's first tokens (remote_send's `first`): it
    # computes its whole prompt, the last position included, for its logits.
    samples_last: bool = False
    is_admitted_once: bool = False
    status: SeqStatus = SeqStatus.WAITING
    waiting_since_s: float = 0.0  # when the scheduler queued it (its clock)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def decodes_next(self) -> bool:
        """Its KV is all computed but its next token's: one position to compute, a decode row
        (a continuation from a whole-prompt reservation starts so)."""
        return self.num_pending_tokens == 1 and self.num_computed_tokens > 0

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def max_prefix_match_tokens(self) -> int:
        # A generate sequence must compute at least its last token to get logits; a send job
        # may take its whole window from the cache, unless it samples.
        return self.num_tokens if self.kind is SeqKind.SEND and not self.samples_last else self.num_tokens - 1

    @property
    def needs_logits_after(self) -> bool:
        """Whether the step that computes its last pending token samples from it."""
        return self.kind is SeqKind.GENERATE or self.samples_last

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
