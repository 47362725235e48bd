"""Token-exact disaggregation between two in-process engines: prep_recv on D, remote_send on
P, KV copied through export/import, start_generate on D == one engine alone."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_test_utils import GREEDY, generate_alone, random_prompt, tokens_of

from engine_shim.engine.api import SamplingParams
from engine_shim.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.unit


def balanced_end(factor: float, length: int) -> int:
    # MLC's router: end = -1 if |f| < 1e-5 else int((1 - f) * len(prompt))
    return -1 if abs(factor) < 1e-5 else int((1 - factor) * length)


def run_pd(
    prefill: LLMEngine, decode: LLMEngine, request_id: str, ids: list[int], end: int,
    sampling: SamplingParams = GREEDY,
) -> tuple[list[int], int]:
    recv = decode.prep_recv(request_id, ids, end)
    if recv.prefix_matched_length < recv.end:  # MLC skips remote_send when D holds it all
        for chunk in prefill.run_remote_send(request_id, ids, recv.prefix_matched_length, recv.end):
            decode.import_kv(request_id, chunk)
    decode.start_generate(request_id, ids, recv.end, sampling)
    return tokens_of(decode.run_until_done()[request_id]), recv.prefix_matched_length


@pytest.fixture
def trio(make_engine: Callable[..., LLMEngine]) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    # Small export chunks so multi-page prompts cross several chunks.
    return tuple(make_engine(kv_export_chunk_tokens=40) for _ in range(3))  # type: ignore[return-value]


@pytest.mark.parametrize("factor", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("length", [9, 150])
def test_pd_matches_single_engine_at_temperature_0(trio, factor: float, length: int) -> None:
    single, prefill, decode = trio
    ids = random_prompt(length, length)
    expected = generate_alone(single, "ref", ids, GREEDY)
    got, matched = run_pd(prefill, decode, "pd", ids, balanced_end(factor, length))
    assert matched == 0
    assert got == expected
    for engine in trio:
        assert engine.status().num_free_pages == engine.num_pages


def test_pd_with_prefix_hit_on_decode_engine(trio) -> None:
    single, prefill, decode = trio
    shared = random_prompt(1, 100)
    first, second = shared + random_prompt(2, 20), shared + random_prompt(3, 30)
    generate_alone(decode, "warm", first, GREEDY)
    got, matched = run_pd(prefill, decode, "pd", second, -1)
    assert matched == 96  # six full pages of the shared 100 tokens
    assert prefill.status().prefix_cache.num_hit_tokens == 0
    assert got == generate_alone(single, "ref", second, GREEDY)


def test_pd_with_prefix_hit_on_prefill_engine(trio) -> None:
    single, prefill, decode = trio
    shared = random_prompt(4, 70)
    generate_alone(prefill, "warm", shared + random_prompt(5, 10), GREEDY)
    second = shared + random_prompt(6, 40)
    got, matched = run_pd(prefill, decode, "pd", second, -1)
    assert matched == 0
    assert prefill.status().prefix_cache.num_hit_tokens == 64
    assert got == generate_alone(single, "ref", second, GREEDY)


def test_pd_with_prefix_hits_on_both_engines(trio) -> None:
    single, prefill, decode = trio
    shared = random_prompt(7, 50)
    generate_alone(decode, "warm-d", shared + random_prompt(8, 5), GREEDY)
    generate_alone(prefill, "warm-p", shared + random_prompt(9, 60) + [1], GREEDY)
    second = shared + random_prompt(9, 60) + random_prompt(10, 20)
    got, matched = run_pd(prefill, decode, "pd", second, balanced_end(0.1, len(second)))
    assert matched == 48
    assert prefill.status().prefix_cache.num_hit_tokens > 48  # P reused more than D had
    assert got == generate_alone(single, "ref", second, GREEDY)


def test_prefix_cache_after_pd_serves_the_next_request_on_decode(trio) -> None:
    single, prefill, decode = trio
    ids = random_prompt(12, 90)
    run_pd(prefill, decode, "pd1", ids, -1)
    again = ids + random_prompt(13, 5)
    got, matched = run_pd(prefill, decode, "pd2", again, -1)
    assert matched == 80  # imported + decoded pages were cached on D
    assert got == generate_alone(single, "ref", again, GREEDY)


def test_long_prompt_spanning_many_pages_and_chunks(make_engine) -> None:
    single, prefill, decode = (make_engine(kv_export_chunk_tokens=256, prefill_chunk_size=128) for _ in range(3))
    ids = random_prompt(14, 700)  # 44 pages, 3 export chunks, 6 prefill chunks
    expected = generate_alone(single, "ref", ids, GREEDY)
    got, _ = run_pd(prefill, decode, "pd", ids, balanced_end(0.1, len(ids)))
    assert got == expected
