"""The capacity benchmark's yardstick: the embedded engine alone, on its own step loop in a
process of its own, with the stack's workload (closed-loop streams, fixed lengths)."""

from __future__ import annotations

import pytest

from bench.capacity.engine_alone import EngineAlone


def test_the_engine_alone_runs_the_closed_loop_in_its_own_process() -> None:
    alone = EngineAlone("tiny", "cpu", max_num_seqs=8, shim_env={})
    try:
        assert alone.pid > 0
        results = [alone.run(streams=3, input_len=8, output_len=5, num_requests=7, seed=1,
                             staggered=staggered) for staggered in (False, True)]
        again = alone.run(streams=2, input_len=8, output_len=3, num_requests=2, seed=2)
    finally:
        alone.close()
    for result, staggered in zip(results, (False, True), strict=True):
        assert result.num_tokens == 7 * 5  # every request's every token, counted once
        assert result.streams == 3 and result.staggered is staggered
        assert result.tok_s == pytest.approx(result.num_tokens / result.span_s)
        assert 0 < result.ttft_p50_s < result.span_s
        assert result.engine_steps is not None and result.engine_steps["steps"] >= 5
    assert again.num_tokens == 2 * 3  # the loaded engine serves the next run too
    assert not alone._process.is_alive()


def test_each_run_of_the_engine_alone_starts_on_an_empty_prefix_cache() -> None:
    """The runs of one stream count share their seed, so their prompts: a run must not find
    the prompts of the runs before it in the prefix cache (the stack's engines meet each
    cell's prompts for the first time)."""
    alone = EngineAlone("tiny", "cpu", max_num_seqs=8, shim_env={})
    try:
        first, again = (alone.run(streams=2, input_len=40, output_len=3, num_requests=4, seed=7)
                        for _ in range(2))
    finally:
        alone.close()
    assert first.num_tokens == again.num_tokens == 4 * 3
    assert first.prefix_hit_tokens == 0
    assert again.prefix_hit_tokens == 0  # the same 40-token prompts again: no page of them hit
