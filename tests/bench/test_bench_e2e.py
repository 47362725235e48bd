"""The bench CLI against a real stack started by `microserving up` (tiny model, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.patterns import READY
from bench.procs import start_service, stop_service

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def stack_url(tmp_path_factory: pytest.TempPathFactory) -> object:
    logs = tmp_path_factory.mktemp("up-logs")
    up = start_service("up", ["up", "--port", "0", "--router-port", "0"], logs, pattern=READY,
                       timeout_s=180)
    try:
        assert up.found is not None
        yield up.found["url"]
    finally:
        stop_service(up)
    assert up.process.returncode is not None


def test_bench_against_the_gateway_has_no_errors_and_sane_figures(
    stack_url: str, tmp_path: Path
) -> None:
    code = main([
        "--base-url", stack_url, "--concurrency", "3", "--num-prompts", "6", "--warmup", "1",
        "--input-len", "uniform:20,40", "--output-len", "8", "--prompt-token-ids",
        "--tokenizer", "tiny", "--ignore-eos", "--no-progress", "--out", str(tmp_path),
    ])
    assert code == 0
    result = json.loads((tmp_path / "results.json").read_text())
    s = result["summary"]
    assert s["num_errors"] == 0, s["error_kinds"]
    assert s["num_completed"] == 6 and s["output_tokens"] == 6 * 8
    for request in result["requests"]:
        assert request["prompt_tokens"] == request["input_len"]  # token-id prompts are exact
        assert 0 < request["ttft_s"] <= request["jct_s"]
    assert s["tpot_s"]["mean"] > 0 and s["requests_per_s"] > 0


def test_chat_endpoint_through_the_gateway(stack_url: str, tmp_path: Path) -> None:
    code = main([
        "--base-url", stack_url, "--endpoint", "chat", "--dataset", "short-chat",
        "--concurrency", "2", "--num-prompts", "4", "--warmup", "0", "--output-len", "6",
        "--input-len", "uniform:10,30", "--ignore-eos", "--no-progress", "--out", str(tmp_path),
    ])
    assert code == 0
    s = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert s["num_errors"] == 0, s["error_kinds"]
    assert s["output_tokens"] == 4 * 6


def test_default_lengths_fit_the_stack_up_starts(stack_url: str, tmp_path: Path) -> None:
    """No --input-len / --output-len: the defaults (3000 in, 100 out) shrink to the tiny
    model's context, measured in its tokens (the served model is a preset)."""
    code = main(["--base-url", stack_url, "--concurrency", "2", "--num-prompts", "2",
                 "--warmup", "0", "--no-progress", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "results.json").read_text())
    s, workload = result["summary"], result["config"]["workload"]
    assert s["num_errors"] == 0 and s["num_completed"] == 2, s["error_kinds"]
    assert workload["tokenizer"] == "tiny"
    assert int(workload["input_len"]) + int(workload["output_len"]) <= 2048
    for request in result["requests"]:
        assert request["prompt_tokens"] <= int(workload["input_len"]) + 1  # + bos
