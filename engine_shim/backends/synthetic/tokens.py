"""BENCHMARK ONLY. The synthetic engine's "sampler": a deterministic stream of printable
ASCII byte tokens per choice, a function of the prompt, the request's seed and the choice
index only (so every pattern streams the same text for the same request). One token is one
byte is one character of text under the byte-level tokenizer, which lets a client count
tokens from text even when a hop merges several tokens into one chunk."""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import chain, islice

from engine_shim.engine.api import InvalidRequestError, SamplingParams
from engine_shim.engine.sampler import SampledToken

# Letters roughly by English frequency, and spaces, so the text looks like words.
_ALPHABET = "etaoinshrdlucmfwypvbgkqjxz     ETAOINS.,"
_TOKEN_IDS = tuple(ord(c) for c in _ALPHABET)
_DISTINCT_IDS = tuple(dict.fromkeys(_TOKEN_IDS))
_TOKEN_LOGPROB = -1.0  # what the synthetic "model" claims for each drawn token


class TokenStream:
    """The tokens one choice will emit, drawn on demand."""

    __slots__ = ("_rng", "_top_logprobs", "_with_logprobs")

    def __init__(self, prompt: Sequence[int], sampling: SamplingParams, choice_index: int) -> None:
        # hash() of a tuple of ints is the same in every process (no hash randomisation).
        seed = hash((tuple(prompt), sampling.seed or 0, choice_index))
        self._rng = random.Random(seed)
        self._with_logprobs = sampling.logprobs
        self._top_logprobs = sampling.top_logprobs

    def next(self) -> SampledToken:
        token_id = self._rng.choice(_TOKEN_IDS)
        if not self._with_logprobs:
            return SampledToken(token_id)
        if not self._top_logprobs:  # the MLC shim's case: logprobs for the ids, no alternatives
            return SampledToken(token_id, _TOKEN_LOGPROB, ())
        ranked = chain((token_id,), (t for t in _DISTINCT_IDS if t != token_id))
        top = tuple((t, _TOKEN_LOGPROB - 0.5 * i) for i, t in enumerate(islice(ranked, self._top_logprobs)))
        return SampledToken(token_id, _TOKEN_LOGPROB, top)


def refuse_unmodelled(sampling: SamplingParams) -> None:
    """The synthetic draw ignores temperature, top_p and top_k (it is a fixed function of
    prompt, seed and choice); options that would change which tokens are legal are refused."""
    if sampling.logit_bias or sampling.frequency_penalty or sampling.presence_penalty:
        raise InvalidRequestError(
            "the synthetic (benchmark-only) backend does not model logit_bias or penalties"
        )
