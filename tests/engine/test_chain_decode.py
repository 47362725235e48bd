"""Chained decode steps (EngineConfig.chain_decode, on by default on CUDA with overlapped
steps): while every running request is plain greedy, the engine launches step N+1 with input
ids taken on the device from step N's argmax, before step N's tokens reach the host. Forced on
here on the CPU, it must give exactly the plain engine's tokens, text, finish reasons and usage
while requests finish (length, stop token), arrive, abort and cross page boundaries, and leave
every page free."""

from __future__ import annotations

from collections.abc import Callable

from engine_test_utils import sample_first_and_export

from engine_shim.engine.api import FinishReason, GenerateOutput, SamplingParams
from engine_shim.engine.llm_engine import LLMEngine


def _greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def _drive(
    engine: LLMEngine,
    first: dict[str, tuple[list[int], SamplingParams]],
    later: dict[int, dict[str, tuple[list[int], SamplingParams]]] | None = None,
    abort_at: dict[int, str] | None = None,
) -> dict[str, list[GenerateOutput]]:
    """Runs to completion; `later` adds requests and `abort_at` aborts one at given step calls."""
    for request_id, (prompt, sampling) in first.items():
        engine.add_request(request_id, prompt, sampling)
    later, abort_at = later or {}, abort_at or {}
    outputs: dict[str, list[GenerateOutput]] = {}
    steps = 0
    while engine.has_work or any(k > steps for k in later):
        steps += 1
        for request_id, (prompt, sampling) in later.get(steps, {}).items():
            engine.add_request(request_id, prompt, sampling)
        if steps in abort_at:
            assert engine.abort(abort_at[steps])
        for event in engine.step():
            assert isinstance(event, GenerateOutput)
            outputs.setdefault(event.request_id, []).append(event)
        assert steps < 5000
    return outputs


def _summary(outputs: list[GenerateOutput]) -> tuple[list[int], str, object, object]:
    tokens: list[int] = []
    text, reason = "", None
    for output in outputs:
        for delta in output.deltas:
            tokens += delta.token_ids
            text += delta.text
            reason = delta.finish_reason or reason
    return tokens, text, reason, outputs[-1].usage


def _engines(make_engine: Callable[..., LLMEngine], **config: object) -> tuple[LLMEngine, LLMEngine]:
    plain = make_engine(overlap_steps=False, **config)
    chained = make_engine(overlap_steps=True, chain_decode=True, **config)
    assert chained.chain_decode and not plain.overlap_steps
    return plain, chained


def test_chained_steps_give_the_plain_engines_outputs(make_engine: Callable[..., LLMEngine]) -> None:
    plain, chained = _engines(make_engine, page_size=4)
    baseline = chained.status().num_free_pages
    # A stop token the greedy run first reaches at its 3rd token or later ends that request
    # mid-chain.
    probe = _summary(_drive(make_engine(), {"p": ([9, 8, 7, 6, 5], _greedy(12))})["p"])[0]
    stop_at = next(i for i in range(2, len(probe)) if probe[i] not in probe[:i])
    stop_token = probe[stop_at]
    first = {
        "long": ([1, 2, 3, 4, 5, 6, 7], _greedy(40)),
        "short": ([11, 12, 13], _greedy(3)),
        "stop": ([9, 8, 7, 6, 5], _greedy(30, stop_token_ids=(stop_token,))),
        "odd": ([4] * 13, _greedy(23)),
        "doomed": ([2, 7, 1, 8, 2, 8], _greedy(60)),
    }
    later = {
        9: {"late": ([3, 3, 5, 5], _greedy(17))},  # arrives mid-chain: the chain breaks, then resumes
        14: {"later": ([6, 1, 6, 1, 6], _greedy(5))},
    }
    expected = _drive(plain, first, later, abort_at={20: "doomed"})
    got = _drive(chained, first, later, abort_at={20: "doomed"})
    assert chained.num_chained_steps >= 15, chained.num_chained_steps
    assert set(got) == set(expected) == set(first) | {"late", "later"}
    for request_id in set(got) - {"doomed"}:
        assert _summary(got[request_id]) == _summary(expected[request_id]), request_id
    stop = _summary(got["stop"])
    assert stop[2] is FinishReason.STOP and stop[0][-1] == stop_token and len(stop[0]) == stop_at + 1
    assert _summary(got["long"])[2] is FinishReason.LENGTH and len(_summary(got["long"])[0]) == 40
    # Aborted at the same step call, a pipelined engine has collected fewer forwards: its
    # tokens are a prefix of the plain run's.
    doomed, doomed_plain = _summary(got["doomed"]), _summary(expected["doomed"])
    assert doomed[2] is FinishReason.ABORT and doomed[0] and doomed_plain[0][: len(doomed[0])] == doomed[0]
    assert chained.status().num_free_pages == baseline
    assert not chained.has_work


def test_a_sampled_request_keeps_the_engine_off_the_chain_until_it_ends(
    make_engine: Callable[..., LLMEngine],
) -> None:
    # Its token is drawn on the host, so no step may be launched before the host has it.
    plain, chained = _engines(make_engine)
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=10, ignore_eos=True)
    first = {"greedy": ([5, 6, 7, 8], _greedy(30)), "sampled": ([1, 2, 3], sampled)}
    expected, got = _drive(plain, first), _drive(chained, first)
    for request_id in first:
        assert _summary(got[request_id]) == _summary(expected[request_id]), request_id
    # The greedy request runs alone for its last ~20 tokens: chained there, not before.
    assert 10 <= chained.num_chained_steps <= 21, chained.num_chained_steps


def test_a_pool_too_small_for_the_next_page_falls_back_to_the_scheduler(
    make_engine: Callable[..., LLMEngine],
) -> None:
    # 3 sequences of up to 9 pages each in a pool of 14: the chain cannot always get the next
    # page, and the scheduler preempts (the sequence recomputes later) instead.
    reference = make_engine(overlap_steps=False, num_pages=64, page_size=4)
    _, chained = _engines(make_engine, num_pages=14, page_size=4)
    first = {f"r{i}": ([i + 1] * 6, _greedy(28)) for i in range(3)}
    expected, got = _drive(reference, first), _drive(chained, first)
    assert chained.scheduler.num_preemptions > 0 and chained.num_chained_steps > 0
    for request_id in first:
        assert _summary(got[request_id])[:3] == _summary(expected[request_id])[:3], request_id
    assert chained.status().num_free_pages == 14


def test_a_continuation_joins_the_chain(make_engine: Callable[..., LLMEngine]) -> None:
    """A continuation from a whole-prompt reservation (the prefill engine sampled its first
    token and sent the whole prompt's KV) has one position to compute: it joins the running
    chain as a row fed from the host, not a step of schedule()'s. Every request's output is
    the plain engine's, the continuation's is one engine alone's, every page comes back."""
    prefill = make_engine(page_size=4)
    plain, chained = _engines(make_engine, page_size=4)
    prompt, sampling = [5, 9, 2, 6, 5, 3, 5, 8, 9, 7], _greedy(14)
    alone = _summary(_drive(make_engine(page_size=4), {"c": (prompt, sampling)})["c"])[0]
    first, chunks = sample_first_and_export(prefill, "c", prompt, sampling)
    assert isinstance(first.output, GenerateOutput)
    t0 = first.output.deltas[0].token_ids[0]
    running = {"a": ([1, 2, 3, 4, 5, 6, 7], _greedy(30)), "b": ([4] * 9, _greedy(25))}
    results: list[dict[str, list[GenerateOutput]]] = []
    for engine in (plain, chained):
        for request_id, (ids, params) in running.items():
            engine.add_request(request_id, ids, params)
        outputs: dict[str, list[GenerateOutput]] = {}
        steps = 0
        while engine.has_work or steps < 6:
            steps += 1
            if steps == 6:  # mid-chain
                engine.prep_recv("c", prompt, len(prompt), sampling, whole_prompt=True)
                for chunk in chunks:
                    engine.import_kv("c", chunk)
                engine.start_generate("c", prompt, len(prompt), sampling, continuations=[(0, (t0,), b"")])
            for event in engine.step():
                assert isinstance(event, GenerateOutput)
                outputs.setdefault(event.request_id, []).append(event)
            assert steps < 500
        results.append(outputs)
        assert engine.status().num_free_pages == engine.num_pages
    want, got = results
    assert {k: _summary(v)[:3] for k, v in got.items()} == {k: _summary(v)[:3] for k, v in want.items()}
    assert [t0, *_summary(got["c"])[0]] == alone
    assert chained.num_chain_joins == 1 and plain.num_chain_joins == 0
