"""Continuous batching: batched results equal each request alone; preemption recomputes."""

from __future__ import annotations

import pytest
from engine_test_utils import GREEDY, finish_of, generate_alone, random_prompt, tokens_of

from engine_shim.engine.api import FinishReason, SamplingParams
from engine_shim.engine.sampler import choice_seed

pytestmark = pytest.mark.unit


# 32 generations on the CPU: past the suite's 300 s per test with both cores busy.
@pytest.mark.timeout(900)
def test_16_mixed_length_requests_batched_equal_each_alone(make_engine) -> None:
    engine = make_engine(enable_prefix_cache=False, prefill_chunk_size=64)
    prompts = [random_prompt(100 + i, 3 + 11 * i) for i in range(16)]
    alone = [generate_alone(engine, f"alone{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        engine.add_request(f"batch{i}", p, GREEDY)
    outputs = engine.run_until_done()
    assert [tokens_of(outputs[f"batch{i}"]) for i in range(16)] == alone
    assert engine.status().num_free_pages == engine.num_pages


def test_seeded_sampled_request_is_the_same_alone_and_in_a_batch(make_engine) -> None:
    engine = make_engine()
    sampled = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = random_prompt(5, 30)
    alone = generate_alone(engine, "alone", prompt, sampled)
    for i in range(6):
        other = SamplingParams(temperature=1.0, max_tokens=10 + i, ignore_eos=True)
        engine.add_request(f"other{i}", random_prompt(200 + i, 5 + 7 * i), other)
    engine.add_request("batched", prompt, sampled)
    outputs = engine.run_until_done()
    assert tokens_of(outputs["batched"]) == alone
    unseeded = SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=99)
    assert generate_alone(engine, "different-seed", prompt, unseeded) != alone


def test_preemption_under_a_tiny_page_pool_completes_every_request(make_engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [random_prompt(300 + i, 10 + 3 * i) for i in range(5)]
    roomy = make_engine(page_size=4)
    alone = [generate_alone(roomy, f"a{i}", p, params) for i, p in enumerate(prompts)]
    tiny = make_engine(page_size=4, num_pages=20)  # 80 slots; the five need ~180
    for i, p in enumerate(prompts):
        tiny.add_request(f"b{i}", p, params)
    outputs = tiny.run_until_done()
    assert tiny.scheduler.num_preemptions > 0
    assert [tokens_of(outputs[f"b{i}"]) for i in range(5)] == alone
    assert all(finish_of(outputs[f"b{i}"]) is FinishReason.LENGTH for i in range(5))
    assert tiny.status().num_free_pages == tiny.num_pages


def test_n_greater_than_1_shares_the_prompt_and_samples_independently(make_engine) -> None:
    engine = make_engine(page_size=4)
    prompt = random_prompt(9, 21)
    params = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=10, ignore_eos=True)
    engine.add_request("n3", prompt, params)
    first = engine.step()  # prefill + fork + the first token of each choice
    pages_in_use = engine.num_pages - engine.status().num_free_pages
    assert pages_in_use == 6 + 2  # 6 pages of the prompt shared, 2 copies of the partial page
    outputs = first + engine.run_until_done()["n3"]
    choices = [tokens_of(outputs, i) for i in range(3)]
    assert all(len(c) == 10 for c in choices)
    assert len({tuple(c) for c in choices}) == 3
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 30
    # choice 0 uses the seed; choice i > 0 a seed derived from (seed, i), so a request seeded
    # 6 shares no choice with this one (seed + i would make its choice 0 equal choice 1 here)
    def alone(request_id: str, seed: int) -> list[int]:
        single = SamplingParams(temperature=1.0, seed=seed, max_tokens=10, ignore_eos=True)
        return generate_alone(engine, request_id, prompt, single)

    assert alone("seed-5", 5) == choices[0]
    assert alone("derived", choice_seed(5, 1)) == choices[1]
    assert alone("seed-6", 6) not in choices
    assert engine.status().num_free_pages == engine.num_pages
