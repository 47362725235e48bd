"""Small pure sampling functions over one sequence's logits row.

Each sequence samples from its own row with its own torch.Generator, so a seeded request
draws the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .api import SamplingParams

GREEDY_TEMPERATURE = 1e-5  # at or below this, sample the argmax


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the chosen token under the model's distribution
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature <= GREEDY_TEMPERATURE


def is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes or reports the distribution: the argmax of the raw
    logits is the token, so it can be taken on the device for a whole batch at once."""
    return (
        is_greedy(params)
        and not params.logit_bias
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and not params.logprobs
    )


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, output_token_ids: Sequence[int]
) -> torch.Tensor:
    """logits: [V]. OpenAI semantics: penalties count the generated tokens only."""
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.int64)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
        logits = logits.index_add(0, ids, bias)
    has_penalty = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
    if has_penalty and output_token_ids:
        counts = torch.bincount(
            torch.tensor(list(output_token_ids), dtype=torch.int64), minlength=logits.shape[0]
        ).to(logits.dtype)
        logits = logits - params.frequency_penalty * counts
        logits = logits - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def top_k_top_p_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] -> [V] with the excluded tokens at -inf."""
    if top_k > 0 and top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already cover top_p; the best always stays.
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_token_id(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> int:
    """logits: [V] fp32 after penalties."""
    if is_greedy(params):
        return int(torch.argmax(logits).item())
    scaled = top_k_top_p_filter(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def token_logprobs(
    raw_logits: torch.Tensor, token_id: int, num_top: int
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Log-probabilities under the model's own distribution (before penalties/temperature)."""
    logprobs = torch.log_softmax(raw_logits, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[0]))
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True))
    return float(logprobs[token_id].item()), top


def sample(
    raw_logits: torch.Tensor,
    params: SamplingParams,
    output_token_ids: Sequence[int],
    generator: torch.Generator,
) -> SampledToken:
    logits = apply_penalties(raw_logits, params, output_token_ids)
    token_id = sample_token_id(logits, params, generator)
    if not params.logprobs:
        return SampledToken(token_id)
    logprob, top = token_logprobs(raw_logits, token_id, params.top_logprobs)
    return SampledToken(token_id, logprob, top)


def choice_seed(seed: int, index: int) -> int:
    """The generator seed of choice `index` of a request seeded `seed`. Choice 0 uses the seed
    itself; the others a hash of (seed, index), so the choices of two requests never share a
    generator as `seed + index` would (seed 1's second choice was seed 2's first)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: any torch.Generator takes it
