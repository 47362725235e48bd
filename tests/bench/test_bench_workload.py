"""Length distributions, synthetic prompts and statistics (pure parts)."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from bench.loadgen.distributions import parse_length_dist
from bench.loadgen.runner import LoadShape, arrival_times_s
from bench.loadgen.stats import describe, percentile
from bench.loadgen.workload import WorkloadConfig, build_workload
from microserving.tokenizer import Tokenizer


def test_length_distributions_parse_and_sample_in_range() -> None:
    rng = random.Random(0)
    assert parse_length_dist("3000").sample(rng) == 3000
    uniform = [parse_length_dist("uniform:100,200").sample(rng) for _ in range(500)]
    assert min(uniform) >= 100 and max(uniform) <= 200
    normal = [parse_length_dist("normal:3000,300").sample(rng) for _ in range(2000)]
    assert abs(statistics.fmean(normal) - 3000) < 40
    assert 250 < statistics.pstdev(normal) < 350


@pytest.mark.parametrize("text", ["", "abc", "normal:1", "uniform:5,2", "0", "poisson:3,1"])
def test_bad_length_distributions_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="bad length distribution"):
        parse_length_dist(text)


def test_token_id_prompts_have_exact_lengths_with_a_tokenizer() -> None:
    cfg = WorkloadConfig(input_len="uniform:50,80", output_len="7", prompt_token_ids=True,
                         tokenizer="tiny", seed=3)
    specs = build_workload(cfg, 10)
    for spec in specs:
        assert isinstance(spec.prompt, list) and len(spec.prompt) == spec.input_len
        assert 50 <= spec.input_len <= 80 and spec.max_tokens == 7


def test_text_prompts_tokenize_to_the_wanted_length() -> None:
    cfg = WorkloadConfig(input_len="300", tokenizer="tiny", seed=4)
    tokenizer = Tokenizer.from_model("tiny")
    for spec in build_workload(cfg, 3):
        assert isinstance(spec.prompt, str)
        assert abs(len(tokenizer.encode(spec.prompt, add_special_tokens=False)) - 300) <= 2


def test_the_same_seed_gives_the_same_workload() -> None:
    cfg = WorkloadConfig(input_len="normal:100,20", output_len="uniform:5,50", seed=9)
    assert build_workload(cfg, 5) == build_workload(cfg, 5)
    assert build_workload(cfg, 5) != build_workload(WorkloadConfig(seed=10), 5)


def test_jsonl_dataset_is_read_and_cycled(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "hello there", "max_tokens": 3}, {"messages": [{"role": "user", "content": "hi"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    specs = build_workload(WorkloadConfig(dataset=str(path), output_len="9"), 5)
    assert [s.prompt for s in specs[:3]] == ["hello there", None, "hello there"]
    assert specs[0].max_tokens == 3 and specs[1].max_tokens == 9


def test_poisson_arrivals_have_the_requested_mean_rate() -> None:
    times = arrival_times_s(4001, 8.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / 4000 == pytest.approx(1 / 8.0, rel=0.05)


def test_load_shape_needs_exactly_one_of_concurrency_and_rate() -> None:
    with pytest.raises(ValueError):
        LoadShape()
    with pytest.raises(ValueError):
        LoadShape(concurrency=2, request_rate=1.0)


def test_percentiles_interpolate_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(7.6)
    summary = describe(values)
    assert summary is not None and summary["mean"] == 4.0 and summary["max"] == 10.0
    assert describe([]) is None
