"""The sender samples the first tokens (remote_send's `first`), the receiver continues them
(start_generate's `continuations`): the client's whole output -- the sender's first output
followed by the receiver's -- equals one engine alone's, token for token and character for
character: greedy and seeded sampling, n > 1, logprobs, stop strings, penalties, and choices
that end with their first token. Every page comes back on both engines."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_test_utils import random_prompt, sample_first_and_export

from engine_shim.engine.api import (
    Continuation,
    FinishReason,
    GenerateOutput,
    InvalidRequestError,
    SamplingParams,
)
from engine_shim.engine.disaggregation import FirstTokens
from engine_shim.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.unit

Flat = dict[int, tuple[list[int], str, list[float], FinishReason | None]]


def flatten(outputs: list[GenerateOutput]) -> Flat:
    """Per choice: every token, the whole text, the logprobs, the finish reason."""
    flat: Flat = {}
    for output in outputs:
        for delta in output.deltas:
            ids, text, logprobs, _ = flat.setdefault(delta.index, ([], "", [], None))
            ids.extend(delta.token_ids)
            logprobs.extend(lp.logprob for lp in delta.logprobs)
            flat[delta.index] = (ids, text + delta.text, logprobs, delta.finish_reason)
    return flat


def assert_same(got: Flat, expected: Flat) -> None:
    """Tokens, text and finish exact; logprobs to float rounding (the receiver computes the
    prompt's last position in a step of another shape than the engine alone)."""
    assert got.keys() == expected.keys()
    for index, (ids, text, logprobs, finish) in expected.items():
        assert got[index][0] == ids
        assert got[index][1] == text
        assert got[index][2] == pytest.approx(logprobs, abs=1e-4)
        assert got[index][3] == finish


def alone(engine: LLMEngine, ids: list[int], sampling: SamplingParams) -> tuple[Flat, list[GenerateOutput]]:
    engine.start_generate("alone", ids, 0, sampling)
    outputs = engine.run_until_done()["alone"]
    return flatten(outputs), outputs


def first_then_continue(
    prefill: LLMEngine, decode: LLMEngine, ids: list[int], sampling: SamplingParams,
    whole: bool = False,
) -> tuple[Flat, list[GenerateOutput], FirstTokens]:
    """MLC's window (D computes from the prompt's last position) or, `whole`, the whole
    prompt's (prep_recv's whole_prompt: D computes only the first token), P sampling the
    first tokens; D starts with P's continuations once the KV is in."""
    recv = decode.prep_recv("pd", ids, len(ids), sampling, whole_prompt=True) if whole else \
        decode.prep_recv("pd", ids, -1, sampling)
    first, chunks = sample_first_and_export(prefill, "pd", ids, sampling, recv.prefix_matched_length, recv.end)
    for chunk in chunks:
        decode.import_kv("pd", chunk)
    output = first.output
    assert isinstance(output, GenerateOutput)
    continuations: list[Continuation] = [
        (d.index, tuple(d.token_ids), state)
        for d, state in zip(output.deltas, first.sampler_states, strict=True)
    ]
    decode.start_generate("pd", ids, recv.end, sampling, continuations=continuations)
    outputs = [output, *decode.run_until_done().get("pd", [])]
    return flatten(outputs), outputs, first


@pytest.fixture
def trio(make_engine: Callable[..., LLMEngine]) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    return tuple(make_engine(kv_export_chunk_tokens=40) for _ in range(3))  # type: ignore[return-value]


def _all_pages_back(*engines: LLMEngine) -> None:
    for engine in engines:
        assert engine.status().num_free_pages == engine.num_pages
        assert not engine.has_work


SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
    "seeded-n3": SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=10, ignore_eos=True),
    "logprobs": SamplingParams(temperature=0.7, seed=3, logprobs=True, top_logprobs=3, max_tokens=8,
                               ignore_eos=True),
    "penalties": SamplingParams(temperature=0.8, seed=5, frequency_penalty=1.5, presence_penalty=0.5,
                                max_tokens=12, ignore_eos=True),
    "greedy-n2": SamplingParams(temperature=0.0, n=2, max_tokens=6, ignore_eos=True),
}


@pytest.mark.parametrize("whole", [False, True], ids=["mlc-window", "whole-prompt"])
@pytest.mark.parametrize("name", list(SAMPLINGS))
@pytest.mark.parametrize("length", [9, 130])
def test_matches_one_engine(trio, name: str, length: int, whole: bool) -> None:
    single, prefill, decode = trio
    sampling = SAMPLINGS[name]
    ids = random_prompt(length, length)
    expected, _ = alone(single, ids, sampling)
    got, _, first = first_then_continue(prefill, decode, ids, sampling, whole)
    assert_same(got, expected)
    assert len(got) == sampling.n
    # the first output is one token per choice; greedy sampling carries no generator state
    assert isinstance(first.output, GenerateOutput)
    assert [len(d.token_ids) for d in first.output.deltas] == [1] * sampling.n
    assert all((state == b"") == (sampling.temperature == 0.0) for state in first.sampler_states)
    _all_pages_back(*trio)


def test_usage_counts_the_first_tokens_once(trio) -> None:
    single, prefill, decode = trio
    sampling = SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=5, ignore_eos=True)
    ids = random_prompt(3, 40)
    _, expected = alone(single, ids, sampling)
    _, got, _ = first_then_continue(prefill, decode, ids, sampling)
    assert got[-1].usage is not None and expected[-1].usage is not None
    assert got[-1].usage.completion_tokens == expected[-1].usage.completion_tokens == 10
    assert got[-1].usage.prompt_tokens == 40
    assert got[0].usage is None  # the choices go on: no usage with the first tokens


@pytest.mark.parametrize("where", [1, 2, 4])
def test_stop_string_at_or_after_the_first_token(trio, where: int) -> None:
    """A stop string the first token's text completes ends the request on the sender; one
    that spans the first tokens, or comes later, ends it on the receiver: the text is cut
    the same either way."""
    single, prefill, decode = trio
    ids = random_prompt(73, 30)  # greedy: one character a token, none repeats in the first four
    base = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    _, probe = alone(single, ids, base)
    texts = [d.text for o in probe for d in o.deltas]
    assert [len(t) for t in texts[:4]] == [1, 1, 1, 1] and len(set(texts[:4])) == 4
    # where 1: the first token's text; 2: across the first two; 4: the fourth token's
    stop = {1: texts[0], 2: texts[0] + texts[1], 4: texts[3]}[where]
    sampling = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=(stop,))
    expected, expected_outputs = alone(single, ids, sampling)
    got, _, first = first_then_continue(prefill, decode, ids, sampling)
    assert_same(got, expected)
    assert got[0][3] is FinishReason.STOP
    assert isinstance(first.output, GenerateOutput)
    # the sender ends the choice exactly when the engine alone ends it with its first token
    assert first.output.deltas[0].finish_reason == expected_outputs[0].deltas[0].finish_reason
    _all_pages_back(*trio)


def test_every_choice_ends_with_its_first_token(trio) -> None:
    """max_tokens=1: the sender's output ends the request (usage included); a receiver
    started anyway ends it at once, outputs nothing more and frees its reservation."""
    single, prefill, decode = trio
    sampling = SamplingParams(temperature=0.5, seed=9, n=2, max_tokens=1, ignore_eos=True)
    ids = random_prompt(4, 50)
    expected, _ = alone(single, ids, sampling)
    got, outputs, first = first_then_continue(prefill, decode, ids, sampling)
    assert_same(got, expected)
    assert isinstance(first.output, GenerateOutput) and first.output.usage is not None
    assert first.output.usage.completion_tokens == 2
    assert len(outputs) == 2 and not outputs[1].deltas and outputs[1].usage is not None
    _all_pages_back(*trio)


def test_one_of_two_choices_ends_with_its_first_token(make_engine) -> None:
    """n = 2 where choice 0's first token is a stop token: choice 1 alone goes on, on the
    reservation's pages."""
    single, prefill, decode = (make_engine() for _ in range(3))
    ids = random_prompt(8, 20)
    probe = SamplingParams(temperature=1.0, seed=13, n=2, max_tokens=1, ignore_eos=True)
    _, probe_outputs = alone(single, ids, probe)
    firsts = [d.token_ids[0] for o in probe_outputs for d in o.deltas]
    sampling = SamplingParams(temperature=1.0, seed=13, n=2, max_tokens=6, ignore_eos=True,
                              stop_token_ids=(firsts[0],))
    expected, _ = alone(single, ids, sampling)
    got, _, _ = first_then_continue(prefill, decode, ids, sampling)
    assert_same(got, expected)
    if firsts[0] != firsts[1]:
        assert len(got[0][0]) == 1 and got[0][3] is FinishReason.STOP
        assert len(got[1][0]) == 6
    _all_pages_back(single, prefill, decode)


def test_abort_before_the_first_tokens_drops_them(make_engine) -> None:
    prefill = make_engine()
    ids = random_prompt(5, 30)
    prefill.remote_send("x", ids, 0, -1, first=SamplingParams(temperature=0.0, max_tokens=4))
    assert prefill.abort("x")
    events = [e for _ in range(5) for e in prefill.step()]
    # one FirstTokens without output: the sampling was dropped, none will come
    assert [e.output for e in events if isinstance(e, FirstTokens)] == [None]
    _all_pages_back(prefill)


@pytest.mark.parametrize("continuations, message", [
    ([(0, (1,), b""), (1, (2,), b"")], "2 given for n=1"),
    ([(1, (1,), b"")], "index order"),
    ([(0, (), b"")], "no token"),
    ([(0, (10**6,), b"")], "outside the vocabulary"),
    ([(0, (1,), b"not a generator state")], "sampler_state"),
])
def test_bad_continuations_are_refused(make_engine, continuations, message: str) -> None:
    engine = make_engine()
    ids = random_prompt(6, 10)
    sampling = SamplingParams(temperature=0.5, seed=1, max_tokens=4)
    with pytest.raises(InvalidRequestError, match=message):
        engine.start_generate("bad", ids, 0, sampling, continuations=continuations)
    _all_pages_back(engine)


@pytest.mark.parametrize("name", ["greedy", "seeded-n3", "logprobs"])
def test_matches_one_engine_with_overlapped_steps(make_engine, name: str) -> None:
    """With step pipelining (the CUDA default) the sender samples a forward late, the
    receiver defers text and chains decodes: the output is the same."""
    single, prefill, decode = (make_engine(overlap_steps=True) for _ in range(3))
    sampling = SAMPLINGS[name]
    ids = random_prompt(17, 70)
    expected, _ = alone(single, ids, sampling)
    got, _, _ = first_then_continue(prefill, decode, ids, sampling)
    assert_same(got, expected)
    _all_pages_back(single, prefill, decode)


def test_whole_prompt_window_starts_with_a_plain_decode(trio) -> None:
    """prep_recv(whole_prompt) reserves [0, len); P's send covers it; D's continuation from
    len(prompt) has one position to compute, the first token's: a decode row, no prefill."""
    _, prefill, decode = trio
    sampling = SAMPLINGS["greedy"]
    ids = random_prompt(40, 40)
    recv = decode.prep_recv("pd", ids, len(ids), sampling, whole_prompt=True)
    assert recv.end == len(ids)
    first, chunks = sample_first_and_export(prefill, "pd", ids, sampling)
    assert chunks[-1].begin + chunks[-1].num_tokens == len(ids)
    for chunk in chunks:
        decode.import_kv("pd", chunk)
    assert isinstance(first.output, GenerateOutput)
    decode.start_generate("pd", ids, len(ids), sampling,
                          continuations=[(0, tuple(first.output.deltas[0].token_ids), b"")])
    (seq,) = decode.scheduler.waiting
    assert seq.num_computed_tokens == len(ids) and seq.num_pending_tokens == 1
    decode.run_until_done()
    _all_pages_back(prefill, decode)


def test_whole_prompt_reservation_leaves_the_last_position_to_the_sender(make_engine) -> None:
    """A prompt the receiver holds whole in its prefix cache: a whole-prompt reservation
    matches at most len - 1 positions (the sender always sends the last one), MLC's window
    as before."""
    engine = make_engine(page_size=4)
    ids = random_prompt(5, 16)  # four full pages
    engine.start_generate("warm", ids, 0, SamplingParams(temperature=0.0, max_tokens=2))
    engine.run_until_done()
    whole = engine.prep_recv("w", ids, len(ids), whole_prompt=True)
    assert whole.end == len(ids) and whole.prefix_matched_length == 12
    engine.abort("w")


def test_whole_windows_only_where_asked(make_engine) -> None:
    """end = len(prompt) needs whole_prompt (prep_recv), a sampling sender (remote_send),
    continuations (start_generate): MLC's rules otherwise."""
    engine = make_engine()
    ids = random_prompt(6, 20)
    greedy = SAMPLINGS["greedy"]
    with pytest.raises(InvalidRequestError, match="outside"):
        engine.prep_recv("a", ids, len(ids))
    with pytest.raises(InvalidRequestError, match="< len"):
        engine.remote_send("b", ids, 0, len(ids))
    with pytest.raises(InvalidRequestError, match="outside"):
        engine.start_generate("c", ids, len(ids), greedy)
    with pytest.raises(InvalidRequestError, match="outside"):
        engine.prep_recv("d", ids, len(ids) + 1, whole_prompt=True)
    assert not engine.has_work
