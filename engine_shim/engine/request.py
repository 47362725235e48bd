"""Per-request generation state: one Choice per `n`, each with its sequence, generator,
incremental detokenizer and stop-string matcher, turned into Deltas.

A request of n > 1 choices starts as one sequence; on its first sampled token the other
choices fork from it (same prompt and KV, a seed of their own) and all sample from the same
logits. The engine shares the pages; what a fork copies and when is decided here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from microserving.tokenizer import IncrementalDecoder, Tokenizer

from .api import (
    FinishReason,
    GenerateOutput,
    InvalidRequestError,
    PackedDelta,
    PackedOutput,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    Usage,
    unpack_output,
)
from .sampler import SampledToken, choice_seed
from .sequence import SeqKind, SeqStatus, Sequence


@dataclass(eq=False)
class Choice:
    index: int
    seq: Sequence
    generator: torch.Generator
    decoder: IncrementalDecoder
    finish_reason: FinishReason | None = None
    text: str = ""  # detokenized output, cut at a stop string
    num_sent_chars: int = 0
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    is_reported_finished: bool = False
    # Sampled ids whose text is still to be decoded (add_token with defer_text): the engine
    # decodes them with feed_deferred_text while the device runs the next step.
    unfed_token_ids: list[int] = field(default_factory=list)
    needs_flush: bool = False  # finished with its text deferred: flush after the last feed

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class GenerateRequest:
    request_id: str
    sampling: SamplingParams
    max_tokens: int
    num_prompt_tokens: int
    stop_token_ids: frozenset[int]
    choices: list[Choice]
    is_forked: bool = False

    @property
    def is_finished(self) -> bool:
        # Asked for every request at every token (add_token, take_output, the core's emit): a
        # generator over the choices took 0.46 us a call against 0.16 with the one choice of
        # n = 1 asked directly (the development VM, timeit).
        choices = self.choices
        if len(choices) != self.sampling.n:
            return False
        if len(choices) == 1:
            return choices[0].is_finished
        return all(c.is_finished for c in choices)

    @property
    def can_defer_text(self) -> bool:
        """Its text never decides anything the next step needs: no stop string can end a
        choice, and no fork waits on a first token (n = 1)."""
        return not self.sampling.stop and self.sampling.n == 1

    def take_fork_indices(self) -> range:
        """Indices of the choices to fork now: 1..n-1 on the first sampled token of an n > 1
        request, nothing at any other time."""
        if self.is_forked:
            return range(0)
        self.is_forked = True
        return range(1, self.sampling.n)

    def preempt(self, placeholder: Callable[[int], Choice]) -> list[Sequence]:
        """End every choice with PREEMPT: a request of n choices is one unit for the router,
        which re-runs the whole flow once one choice is preempted. Choices never forked are
        reported too, as placeholders. Returns the sequences of the choices this ended, whose
        pages the engine frees."""
        ended = [c.seq for c in self.choices if not c.is_finished]
        for choice in self.choices:
            finish_choice(choice, FinishReason.PREEMPT)
        while len(self.choices) < self.sampling.n:
            choice = placeholder(len(self.choices))
            finish_choice(choice, FinishReason.PREEMPT)
            self.choices.append(choice)
        return ended

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=sum(c.seq.num_output_tokens for c in self.choices),
            cached_tokens=self.choices[0].seq.num_cached_tokens,
            transferred_tokens=self.choices[0].seq.num_transferred_tokens,
        )


def new_choice(
    index: int, seq: Sequence, sampling: SamplingParams, tokenizer: Tokenizer, rng: torch.Generator
) -> Choice:
    """Choice `index` over `seq`: seeded from the request's seed (so each choice of a seeded
    request is reproducible) or else from the engine's generator."""
    if sampling.seed is not None:
        seed = choice_seed(sampling.seed, index)
    else:
        seed = int(torch.randint(0, 2**62, (1,), generator=rng).item())
    return Choice(
        index=index,
        seq=seq,
        generator=torch.Generator().manual_seed(seed),
        decoder=tokenizer.incremental_decoder(),
    )


def stop_token_ids(sampling: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """The ids that end a choice: the request's stop tokens, and the model's EOS unless
    `ignore_eos`."""
    eos = frozenset() if sampling.ignore_eos else frozenset(eos_token_ids)
    return frozenset(sampling.stop_token_ids) | eos


def first_token_request(
    request_id: str, ids: list[int], sampling: SamplingParams, max_tokens: int, stop_ids: frozenset[int],
    new_seq_id: Callable[[], int], new_choice: Callable[[int, Sequence, SamplingParams], Choice],
) -> GenerateRequest:
    """The request whose choices a send job that samples (remote_send's `first`) draws the
    first tokens of: each choice on a sequence of its own holding the prompt, never scheduled."""
    request = GenerateRequest(request_id=request_id, sampling=sampling, max_tokens=max_tokens,
                              num_prompt_tokens=len(ids), stop_token_ids=stop_ids, choices=[], is_forked=True)
    for index in range(sampling.n):
        seq = Sequence(new_seq_id(), request_id, list(ids), len(ids), status=SeqStatus.FINISHED)
        request.choices.append(new_choice(index, seq, sampling))
    return request


def fork_sequence(parent: Sequence, seq_id: int, choice_index: int) -> Sequence:
    """A sibling of `parent` for another choice: its tokens and prompt accounting, no pages
    yet (the engine shares or recomputes them)."""
    child = Sequence(seq_id, parent.request_id, list(parent.token_ids), parent.num_prompt_tokens, SeqKind.GENERATE)
    child.choice_index = choice_index
    child.num_cached_tokens = parent.num_cached_tokens
    child.num_transferred_tokens = parent.num_transferred_tokens
    child.cache_salt = parent.cache_salt
    child.is_disaggregated = parent.is_disaggregated
    return child


def add_token(
    request: GenerateRequest, choice: Choice, sampled: SampledToken, tokenizer: Tokenizer,
    defer_text: bool = False,
) -> None:
    """Record a sampled token (already appended to the sequence) and decide if it finishes.

    With `defer_text` (only for requests without stop strings, whose end never depends on
    the text) the decoding waits for feed_deferred_text; whether the choice finishes is
    known at once either way, so its sequence leaves the batch on time."""
    token_id = sampled.token_id
    choice.pending_token_ids.append(token_id)
    if sampled.logprob is not None:
        choice.pending_logprobs.append(_to_logprob(sampled, tokenizer))
    if token_id in request.stop_token_ids:
        _finish(choice, FinishReason.STOP, flush=not defer_text)
        choice.needs_flush = defer_text
        return
    if defer_text:
        assert not request.sampling.stop
        choice.unfed_token_ids.append(token_id)
        if choice.seq.num_output_tokens >= request.max_tokens:
            _finish(choice, FinishReason.LENGTH, flush=False)
            choice.needs_flush = True
        return
    choice.text += choice.decoder.feed([token_id])
    if _cut_at_stop_string(choice, request.sampling.stop):
        _finish(choice, FinishReason.STOP, flush=False)
    elif choice.seq.num_output_tokens >= request.max_tokens:
        _finish(choice, FinishReason.LENGTH)


def feed_deferred_text(choice: Choice) -> None:
    """Decode what add_token(defer_text=True) left, and flush the decoder if the choice
    finished meanwhile: the same text, in the same deltas, as decoding at once."""
    if choice.unfed_token_ids:
        choice.text += choice.decoder.feed(choice.unfed_token_ids)
        choice.unfed_token_ids = []
    if choice.needs_flush:
        choice.text += choice.decoder.flush()
        choice.needs_flush = False


def replay_tokens(request: GenerateRequest, choice: Choice, token_ids: tuple[int, ...], tokenizer: Tokenizer) -> None:
    """A choice continues output another engine began (its first tokens, sampled there): the
    tokens go through add_token as if sampled here (appended to its sequence, decoded, checked
    for a finish), and what they produced counts as sent, so the deltas from here on are the
    ones the engine that began would have produced next."""
    for token_id in token_ids:
        choice.seq.token_ids.append(token_id)
        add_token(request, choice, SampledToken(token_id), tokenizer)
        if choice.is_finished:
            break
    take_delta_fields(choice, request.sampling.stop)


def sampler_state(choice: Choice) -> bytes:
    """The choice's generator state, for the engine that continues it."""
    return bytes(choice.generator.get_state().numpy().tobytes())


def restore_sampler_state(choice: Choice, state: bytes) -> None:
    try:
        choice.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    except (RuntimeError, ValueError) as error:
        raise InvalidRequestError(f"continuation {choice.index}: sampler_state is not this engine's ({error})") from None


def finish_choice(choice: Choice, reason: FinishReason) -> None:
    if not choice.is_finished:
        _finish(choice, reason)


def take_delta_fields(choice: Choice, stop: tuple[str, ...]) -> PackedDelta | None:
    """What is new since the last delta, as the Delta's fields in order (api.PackedDelta).
    Text that could still grow into a stop string is held back until it cannot (or the
    choice finishes)."""
    if choice.is_reported_finished:
        return None
    end = len(choice.text)
    if not choice.is_finished and stop:
        end = max(choice.num_sent_chars, end - (max(len(s) for s in stop) - 1))
    text = choice.text[choice.num_sent_chars : end]
    if not (choice.pending_token_ids or text or choice.is_finished):
        return None
    delta = (choice.index, tuple(choice.pending_token_ids), text, tuple(choice.pending_logprobs),
             choice.finish_reason)
    choice.num_sent_chars = end
    choice.pending_token_ids, choice.pending_logprobs = [], []
    choice.is_reported_finished = choice.is_finished
    return delta


def take_output(
    request: GenerateRequest, packed: bool, ended: bool = False
) -> GenerateOutput | PackedOutput | None:
    """What is new for the request since its last output (`packed`: as plain tuples,
    api.PackedOutput, as an engine core in a process of its own sends them), its usage once
    it has finished (or `ended`: aborted); None when nothing is new and it goes on."""
    finished = ended or request.is_finished
    stop = request.sampling.stop
    fields = tuple(f for c in request.choices if (f := take_delta_fields(c, stop)) is not None)
    if not (fields or finished):
        return None
    output: PackedOutput = (request.request_id, fields, request.usage() if finished else None)
    return output if packed else unpack_output(output)


def _finish(choice: Choice, reason: FinishReason, flush: bool = True) -> None:
    if flush:
        choice.text += choice.decoder.flush()
    choice.finish_reason = reason


def _cut_at_stop_string(choice: Choice, stop: tuple[str, ...]) -> bool:
    if not stop:
        return False
    search_from = max(0, choice.num_sent_chars - max(len(s) for s in stop))
    hits = [i for i in (choice.text.find(s, search_from) for s in stop) if i >= 0]
    if not hits:
        return False
    choice.text = choice.text[: min(hits)]
    return True


def _to_logprob(sampled: SampledToken, tokenizer: Tokenizer) -> TokenLogprob:
    top = tuple(
        TopLogprob(token_id=t, token=tokenizer.id_to_token_text(t), logprob=lp,
                   token_bytes=tokenizer.id_to_token_bytes(t))
        for t, lp in sampled.top
    )
    return TokenLogprob(
        token_id=sampled.token_id,
        token=tokenizer.id_to_token_text(sampled.token_id),
        logprob=float(sampled.logprob or 0.0),
        top=top,
        token_bytes=tokenizer.id_to_token_bytes(sampled.token_id),
    )
