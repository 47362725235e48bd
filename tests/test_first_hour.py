"""What a new user meets in the first hour: help text on every flag of every command, one list
of built-in models, `--version`, `up --pattern round-robin` using every engine it starts, a
taken port reported before any engine loads, and bench defaults fitted to the served model."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

import bench.cli
import engine_shim.cli
import engine_shim.mlc_http.cli
import gateway.cli
import microserving.cli
import microserving.stack.up
import router.cli
from bench.loadgen.benchmark import ServedModel, fit_workload
from bench.loadgen.workload import WorkloadConfig
from engine_shim.engine.config import MODEL_PRESETS
from microserving.tokenizer import PRESET_NAMES

PARSERS = {
    "shim": engine_shim.cli._parser, "mlc-compat": engine_shim.mlc_http.cli._parser,
    "router": router.cli.build_parser, "gateway": gateway.cli.build_parser,
    "up": microserving.stack.up.build_parser, "bench": bench.cli.build_parser,
}


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_flag_has_help_and_model_flags_list_every_preset(command: str) -> None:
    parser: argparse.ArgumentParser = PARSERS[command]()
    silent = [a.option_strings for a in parser._actions if not (a.help or "").strip()]
    assert silent == []
    for action in parser._actions:  # (bench's --model is a served id, not a model to load)
        if "--model" in action.option_strings and command != "bench":
            assert all(name in (action.help or "") for name in PRESET_NAMES)


def test_one_list_of_built_in_models() -> None:
    assert set(MODEL_PRESETS) == set(PRESET_NAMES)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert microserving.cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "microserving 0.1.0"


def test_round_robin_without_engines_starts_engines_that_both_serve() -> None:
    plan = microserving.stack.up.plan_from_args(["--pattern", "round-robin"])
    assert plan.pattern == "round-robin" and plan.roles == ("both", "both")
    with pytest.raises(SystemExit):
        microserving.stack.up.plan_from_args(["--pattern", "round-robin", "--prefill", "1"])


def test_up_hands_router_class_and_prefix_cache_to_its_children() -> None:
    plan = microserving.stack.up.plan_from_args(["--router-class", "my_router:MyRouter",
                                      "--enable-prefix-cache", "false"])
    router_argv = microserving.stack.up.router_command(plan, [("127.0.0.1:1", "prefill")])
    assert router_argv[-2:] == ["--router-class", "my_router:MyRouter"]
    assert microserving.stack.up.shim_command(plan, "decode")[-2:] == ["--enable-prefix-cache", "false"]


def test_up_has_the_gateway_hold_the_cpu_latency_bound() -> None:
    """One holder a host: the gateway (or `serve`) process; routers and shims are not asked."""
    plan = microserving.stack.up.plan_from_args(["--engines", "2", "--cpu-latency-us", "0"])
    gateway = microserving.stack.up.gateway_command(plan, "127.0.0.1:1")
    assert gateway[gateway.index("--cpu-latency-us") + 1] == "0"
    assert "--cpu-latency-us" in microserving.stack.up.serve_command(plan, Path("router.yaml"))
    assert "--cpu-latency-us" not in microserving.stack.up.router_command(plan, [("127.0.0.1:1", "both")])
    assert "--cpu-latency-us" not in microserving.stack.up.shim_command(plan, "both")
    plain = microserving.stack.up.plan_from_args(["--engines", "2"])
    assert "--cpu-latency-us" not in microserving.stack.up.gateway_command(plain, "127.0.0.1:1")


def test_up_gives_each_router_replica_and_shim_a_metrics_port_of_its_own() -> None:
    plan = microserving.stack.up.plan_from_args(["--engines", "2", "--router-replicas", "2",
                                      "--metrics-base-port", "9100"])

    def metrics_port(argv: list[str]) -> str:
        return argv[argv.index("--metrics-port") + 1]

    engines = [("127.0.0.1:1", "both")]
    assert [metrics_port(microserving.stack.up.router_command(plan, engines, 0, i)) for i in range(2)] == ["9100", "9101"]
    assert [metrics_port(microserving.stack.up.shim_command(plan, "both", i)) for i in range(2)] == ["9102", "9103"]
    plain = microserving.stack.up.plan_from_args(["--engines", "2"])
    assert "--metrics-port" not in microserving.stack.up.shim_command(plain, "both", 0)


def test_up_shares_the_cores_between_its_cpu_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    def threads(argv: list[str]) -> str | None:
        return argv[argv.index("--cpu-threads") + 1] if "--cpu-threads" in argv else None

    monkeypatch.setattr(microserving.stack.up.os, "cpu_count", lambda: 8)
    plan = microserving.stack.up.plan_from_args(["--prefill", "1", "--decode", "3"])
    assert {threads(microserving.stack.up.shim_command(plan, r, i)) for i, r in enumerate(plan.roles)} == {"2"}
    crowded = microserving.stack.up.plan_from_args(["--engines", "12"])
    assert threads(microserving.stack.up.shim_command(crowded, "both")) == "1"
    chosen = microserving.stack.up.plan_from_args(["--engines", "2", "--shim-arg=--cpu-threads=3"])
    assert microserving.stack.up.shim_command(chosen, "both")[-1] == "--cpu-threads=3"
    assert threads(microserving.stack.up.shim_command(chosen, "both")) is None
    gpu = microserving.stack.up.plan_from_args(["--engines", "2", "--device", "cuda"])
    assert threads(microserving.stack.up.shim_command(gpu, "both")) is None


def test_a_taken_gateway_port_fails_before_any_engine_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        plan = microserving.stack.up.plan_from_args(["--port", str(port), "--router-port", "0"])
        stack = microserving.stack.up.Stack(plan)
        with pytest.raises(microserving.stack.up.StartupFailed, match=f"127.0.0.1:{port} \\(--port\\)"):
            stack.start()
    assert stack.children == []  # nothing was spawned


def test_bench_defaults_fit_the_served_context_in_its_tokens() -> None:
    defaults = WorkloadConfig()
    fitted = fit_workload(defaults, ServedModel("tiny", 2048), fit_lengths=True)
    assert fitted.tokenizer == "tiny"
    assert int(fitted.input_len) + int(fitted.output_len) <= 2048 and int(fitted.output_len) == 100
    chosen = WorkloadConfig(input_len="3000", output_len="100")
    assert fit_workload(chosen, ServedModel("tiny", 2048), fit_lengths=False).input_len == "3000"
    remote = fit_workload(defaults, ServedModel("org/remote-model", None), fit_lengths=True)
    assert remote.tokenizer is None and remote.input_len == "3000"
