"""Nothing leaks: free pages return to the baseline however a request ends; and every bad
call raises a domain error while the engine keeps serving."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from engine_test_utils import GREEDY, finish_of, generate_alone, random_prompt, tokens_of

from engine_shim.engine.api import (
    AlreadyExistsError,
    FailedPreconditionError,
    FinishReason,
    InvalidRequestError,
    KVChunk,
    NotFoundError,
    ResourceExhaustedError,
    SamplingParams,
)

pytestmark = pytest.mark.unit


def test_free_pages_return_to_baseline_after_finish_abort_and_ttl(make_engine) -> None:
    engine = make_engine(reservation_ttl_s=0.05)
    baseline = engine.status().num_free_pages
    ids = random_prompt(1, 70)
    generate_alone(engine, "finished", ids, GREEDY)
    assert engine.status().num_free_pages == baseline
    engine.add_request("aborted", random_prompt(2, 50), GREEDY)
    engine.step()
    assert engine.status().num_free_pages < baseline
    assert engine.abort("aborted") is True
    events = engine.step()
    assert [finish_of([e]) for e in events if e.request_id == "aborted"] == [FinishReason.ABORT]  # type: ignore[union-attr]
    assert engine.abort("aborted") is False
    engine.prep_recv("parked", random_prompt(3, 90), -1)
    assert engine.status().num_reserved_requests == 1
    time.sleep(0.06)
    engine.step()
    assert engine.status().num_reserved_requests == 0
    assert engine.status().num_free_pages == baseline
    with pytest.raises(FailedPreconditionError):
        engine.start_generate("parked", random_prompt(3, 90), 89, GREEDY)


def test_preempted_disaggregated_request_finishes_with_preempt_and_frees_pages(make_engine) -> None:
    engine = make_engine(page_size=4, num_pages=12)
    prefill = make_engine(page_size=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("local", random_prompt(4, 6), params)
    first = engine.step()
    ids = random_prompt(5, 9)
    recv = engine.prep_recv("pd", ids, -1)
    for chunk in prefill.run_remote_send("pd", ids, recv.prefix_matched_length, recv.end):
        engine.import_kv("pd", chunk)
    engine.start_generate("pd", ids, recv.end, params)
    outputs = engine.run_until_done()
    outputs["local"] = first + outputs["local"]  # type: ignore[operator]
    assert finish_of(outputs["pd"]) is FinishReason.PREEMPT
    assert finish_of(outputs["local"]) is FinishReason.LENGTH
    assert tokens_of(outputs["local"]) == generate_alone(make_engine(page_size=4), "x", random_prompt(4, 6), params)
    assert engine.status().num_free_pages == engine.num_pages


@pytest.mark.parametrize("steps_before_preempt", [0, 3])  # before the fork, after it
def test_a_preempted_request_of_n_choices_ends_every_choice_with_preempt(
    make_engine, steps_before_preempt: int
) -> None:
    engine = make_engine(page_size=4, num_pages=12)
    prefill = make_engine(page_size=4)
    ids = random_prompt(5, 9)
    recv = engine.prep_recv("pd", ids, -1)
    for chunk in prefill.run_remote_send("pd", ids, recv.prefix_matched_length, recv.end):
        engine.import_kv("pd", chunk)
    params = SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=30, ignore_eos=True)
    engine.start_generate("pd", ids, recv.end, params)
    outputs = [e for _ in range(steps_before_preempt) for e in engine.step()]
    engine.add_request("local", random_prompt(4, 6), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    outputs += engine.run_until_done()["pd"]
    assert [finish_of(outputs, i) for i in range(3)] == [FinishReason.PREEMPT] * 3  # type: ignore[arg-type]
    assert engine.status().num_free_pages == engine.num_pages


def test_remote_send_job_is_released_after_export(make_engine) -> None:
    engine = make_engine()
    ids = random_prompt(6, 100)
    chunks = engine.run_remote_send("send", ids, 10, 90)
    assert [(c.begin, c.num_tokens) for c in chunks] == [(10, 80)]
    assert chunks[0].data.shape == (4, 2, 80, 2, 32)  # type: ignore[attr-defined]
    assert engine.status().num_free_pages == engine.num_pages
    assert engine.status().prefix_cache.num_cached_pages == 5  # [0, 90) -> 5 full pages


def test_a_prompt_given_as_an_integer_array_is_the_same_prompt(make_engine) -> None:
    """The shim hands the core a gRPC message's ids as an int32 array: the engine generates
    what it generates from the list, and the array's pages are the list's prefix."""
    engine = make_engine()
    ids = random_prompt(9, 70)
    expected = generate_alone(engine, "as-list", ids, GREEDY)
    hits = engine.status().prefix_cache.num_hit_tokens
    assert generate_alone(engine, "as-array", np.array(ids, dtype=np.int32), GREEDY) == expected
    assert engine.status().prefix_cache.num_hit_tokens - hits == 64  # the list's 4 full pages
    chunks = engine.run_remote_send("send", np.array(ids, dtype=np.int64), 0, 48)
    assert [(c.begin, c.num_tokens) for c in chunks] == [(0, 48)]


@pytest.fixture(scope="module")
def shared_engine():
    from engine_shim.engine.config import EngineConfig
    from engine_shim.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(num_pages=64, page_size=16, max_context_length=256))


def _bad_calls(engine) -> list[tuple[str, type[Exception], object]]:
    ok = random_prompt(7, 20)
    v = engine.vocab_size
    chunk = KVChunk(begin=0, num_tokens=4, data=torch.zeros(4, 2, 4, 2, 32))
    return [
        ("empty prompt", InvalidRequestError, lambda: engine.add_request("e", [], GREEDY)),
        ("token >= vocab", InvalidRequestError, lambda: engine.add_request("e", [1, v], GREEDY)),
        ("negative token", InvalidRequestError, lambda: engine.add_request("e", [-1, 2], GREEDY)),
        ("bool token", InvalidRequestError, lambda: engine.add_request("e", [1, True], GREEDY)),
        ("float token", InvalidRequestError, lambda: engine.remote_send("e", [*ok[:-1], 2.0], 0, 5)),
        # Arrays (as the shim hands a gRPC message's ids over) are checked by dtype and range.
        ("bool array", InvalidRequestError, lambda: engine.add_request("e", np.array([True, False]), GREEDY)),
        ("float array", InvalidRequestError, lambda: engine.prep_recv("e", np.array([1.0, 2.0, 3.0]), -1)),
        ("2-D array", InvalidRequestError, lambda: engine.add_request("e", np.array([[1, 2]]), GREEDY)),
        ("empty array", InvalidRequestError, lambda: engine.add_request("e", np.array([], np.int32), GREEDY)),
        ("array token >= vocab", InvalidRequestError,
         lambda: engine.remote_send("e", np.array([*ok[:-1], v], np.int32), 0, 5)),
        ("negative array token", InvalidRequestError, lambda: engine.add_request("e", np.array([3, -1]), GREEDY)),
        ("prep_recv end == len", InvalidRequestError, lambda: engine.prep_recv("e", ok, 20)),
        ("prep_recv end < -len", InvalidRequestError, lambda: engine.prep_recv("e", ok, -21)),
        ("remote_send begin == end", InvalidRequestError, lambda: engine.remote_send("e", ok, 5, 5)),
        ("remote_send end == len", InvalidRequestError, lambda: engine.remote_send("e", ok, 0, 20)),
        ("start_generate begin == len", InvalidRequestError, lambda: engine.start_generate("e", ok, 20, GREEDY)),
        ("start_generate without prep_recv", FailedPreconditionError, lambda: engine.start_generate("e", ok, 5, GREEDY)),
        ("import_kv unknown id", NotFoundError, lambda: engine.import_kv("nobody", chunk)),
        ("export unknown id", NotFoundError, lambda: engine.export_kv("nobody", 0, 1)),
        ("context overflow", InvalidRequestError,
         lambda: engine.add_request("e", ok, SamplingParams(max_tokens=237))),
        ("prompt fills the context", InvalidRequestError, lambda: engine.add_request("e", [1] * 256, GREEDY)),
        ("negative temperature", InvalidRequestError, lambda: engine.add_request("e", ok, SamplingParams(temperature=-0.1))),
        ("top_p 0", InvalidRequestError, lambda: engine.add_request("e", ok, SamplingParams(top_p=0.0))),
        ("top_p > 1", InvalidRequestError, lambda: engine.add_request("e", ok, SamplingParams(top_p=1.5))),
        ("top_k < 0", InvalidRequestError, lambda: engine.add_request("e", ok, SamplingParams(top_k=-1))),
        ("n 0", InvalidRequestError, lambda: engine.add_request("e", ok, SamplingParams(n=0))),
        ("max_tokens 0", InvalidRequestError, lambda: engine.add_request("e", ok, SamplingParams(max_tokens=0))),
        ("penalty 3", InvalidRequestError, lambda: engine.add_request("e", ok, SamplingParams(presence_penalty=3))),
        ("logit_bias token", InvalidRequestError, lambda: engine.add_request("e", ok, SamplingParams(logit_bias={v: 1.0}))),
        ("top_logprobs 21", InvalidRequestError, lambda: engine.add_request("e", ok, SamplingParams(logprobs=True, top_logprobs=21))),
        ("empty request id", InvalidRequestError, lambda: engine.add_request("", ok, GREEDY)),
    ]


def test_each_bad_input_raises_the_right_domain_error_and_the_engine_keeps_serving(shared_engine) -> None:
    engine = shared_engine
    baseline = engine.status().num_free_pages
    engine.add_request("busy", random_prompt(8, 40), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    for name, error, call in _bad_calls(engine):
        with pytest.raises(error):
            call()  # type: ignore[operator]
        assert not engine.is_active("e"), name
    with pytest.raises(AlreadyExistsError):
        engine.add_request("busy", [1, 2, 3], GREEDY)
    outputs = engine.run_until_done()
    assert len(tokens_of(outputs["busy"])) == 39  # the first token came from the step above
    assert engine.status().num_free_pages == baseline


def test_bad_kv_chunks_are_rejected_without_touching_the_reservation(shared_engine) -> None:
    engine = shared_engine
    ids = random_prompt(9, 40)
    recv = engine.prep_recv("r", ids, 30)
    good = torch.zeros(4, 2, 10, 2, 32)
    with pytest.raises(InvalidRequestError):
        engine.import_kv("r", KVChunk(begin=25, num_tokens=10, data=good))  # past end
    with pytest.raises(InvalidRequestError):
        engine.import_kv("r", KVChunk(begin=0, num_tokens=10, data=good.half()))  # dtype
    with pytest.raises(InvalidRequestError):
        engine.import_kv("r", KVChunk(begin=0, num_tokens=10, data=torch.zeros(4, 2, 10, 2, 16)))
    with pytest.raises(AlreadyExistsError):
        engine.prep_recv("r", ids, 30)
    with pytest.raises(FailedPreconditionError):  # nothing imported yet
        engine.start_generate("r", ids, recv.end, GREEDY)
    assert engine.abort("r") is True
    assert engine.status().num_free_pages == engine.num_pages


def test_pool_too_small_for_a_prompt_is_resource_exhausted(make_engine) -> None:
    engine = make_engine(page_size=4, num_pages=4)
    with pytest.raises(ResourceExhaustedError):
        engine.add_request("big", random_prompt(1, 40), GREEDY)
    assert generate_alone(engine, "small", random_prompt(1, 5), SamplingParams(temperature=0, max_tokens=3))
