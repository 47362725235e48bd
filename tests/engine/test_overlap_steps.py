"""Step pipelining (EngineConfig.overlap_steps, on by default on CUDA): the engine launches
step N+1 before decoding step N's text. Run here on the CPU with the option forced on, it
must give every request exactly the deltas, text, finish reasons and usage of the plain
engine (an abort ends it one forward earlier), and leave no page behind."""

from __future__ import annotations

from collections.abc import Callable

from engine_shim.engine.api import FinishReason, GenerateOutput, SamplingParams
from engine_shim.engine.llm_engine import LLMEngine

WORKLOAD: dict[str, tuple[list[int], SamplingParams]] = {
    "greedy": ([5, 6, 7, 8] * 9, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
    "sampled": ([9, 10, 11], SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=17, ignore_eos=True)),
    # "stop-string" (added by the test: a piece of greedy's text) ends a choice by its text,
    # so its text is never deferred
    # a stop token (forced by the bias) ends it while its text is deferred
    "stop-token": ([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20, logit_bias={65: 100.0},
                                             stop_token_ids=(65,), ignore_eos=True)),
    "logprobs": ([4, 4, 4], SamplingParams(temperature=0.0, max_tokens=6, logprobs=True, top_logprobs=2, ignore_eos=True)),
    "n2": ([7, 7, 7, 7, 7], SamplingParams(temperature=1.0, n=2, seed=11, max_tokens=9, ignore_eos=True)),
    "aborted": ([3, 1, 4, 1, 5], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)),
}


def _run(engine: LLMEngine, workload: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[GenerateOutput]]:
    for request_id, (prompt, sampling) in workload.items():
        engine.add_request(request_id, prompt, sampling)
    outputs: dict[str, list[GenerateOutput]] = {}
    steps = 0
    while engine.has_work:
        steps += 1
        if steps == 8 and "aborted" in workload:
            assert engine.abort("aborted")
        for event in engine.step():
            assert isinstance(event, GenerateOutput)
            outputs.setdefault(event.request_id, []).append(event)
    return outputs


def _summary(outputs: list[GenerateOutput]) -> dict[int, tuple[list[int], str, object]]:
    by_choice: dict[int, tuple[list[int], str, object]] = {}
    for output in outputs:
        for delta in output.deltas:
            tokens, text, reason = by_choice.get(delta.index, ([], "", None))
            by_choice[delta.index] = (tokens + list(delta.token_ids), text + delta.text, delta.finish_reason or reason)
    return by_choice


def test_overlapped_steps_give_the_same_outputs_and_free_every_page(
    make_engine: Callable[..., LLMEngine],
) -> None:
    plain, overlapped = make_engine(overlap_steps=False), make_engine(overlap_steps=True)
    assert overlapped.overlap_steps and not plain.overlap_steps
    baseline = overlapped.status().num_free_pages
    prompt, greedy = WORKLOAD["greedy"]
    greedy_text = _summary(_run(make_engine(), {"g": (prompt, greedy)})["g"])[0][1]
    stop = greedy_text[8:10]
    assert len(stop) == 2 and greedy_text.find(stop) > 0
    workload = {**WORKLOAD, "stop-string": (prompt, SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, stop=(stop,)))}
    expected, got = _run(plain, workload), _run(overlapped, workload)
    assert set(got) == set(expected) == set(workload)
    # Aborted at the same step call, the overlapped engine has collected one forward fewer
    # (the one in flight is dropped): its tokens and text are a prefix of the plain run's.
    aborted, aborted_plain = _summary(got["aborted"])[0], _summary(expected["aborted"])[0]
    assert aborted[0] and aborted_plain[0][: len(aborted[0])] == aborted[0]
    assert aborted_plain[1].startswith(aborted[1])
    for request_id in set(workload) - {"aborted"}:
        assert _summary(got[request_id]) == _summary(expected[request_id]), request_id
        assert got[request_id][-1].usage == expected[request_id][-1].usage, request_id
        logprobs = [lp for o in got[request_id] for d in o.deltas for lp in d.logprobs]
        assert logprobs == [lp for o in expected[request_id] for d in o.deltas for lp in d.logprobs]
    summary = _summary(got["stop-token"])[0]
    assert summary[2] is FinishReason.STOP and summary[0][-1] == 65
    assert _summary(got["stop-string"])[0][2] is FinishReason.STOP
    assert _summary(got["stop-string"])[0][1] == greedy_text[: greedy_text.find(stop)]
    assert _summary(got["aborted"])[0][2] is FinishReason.ABORT
    assert len(_summary(got["n2"])) == 2
    assert len(_summary(got["greedy"])[0][0]) == 20
    assert overlapped.status().num_free_pages == baseline
    assert not overlapped.has_work
