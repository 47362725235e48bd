"""Benchmarks can run another revision's services (MICROSERVING_BENCH_SERVICE_TREE) under this
tree's load and yardsticks: the service is that tree's module, started from its root."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from bench.capacity.cli import _label
from bench.procs import SERVICE_TREE_ENV, start_service, stop_service

# What the other tree's `microserving.cli` does here: say which file it is and announce an
# address as a service does (the stand-in of a revision's entry point; what is under test is
# which tree's module a benchmark starts).
_CLI = textwrap.dedent("""
    import os, sys, time
    print("cli from", os.path.realpath(__file__), "cwd", os.getcwd(), "args", sys.argv[1:], flush=True)
    print("listening on 127.0.0.1:1", flush=True)
    time.sleep(60)
""")


def _tree(root: Path) -> Path:
    package = root / "microserving"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cli.py").write_text(_CLI)
    return root


def test_a_service_runs_the_named_trees_module_from_its_root(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "other")
    service = start_service("svc", ["--flag"], tmp_path / "logs", timeout_s=60,
                            env={SERVICE_TREE_ENV: str(tree), "PYTHONPATH": "/nonexistent"})
    try:
        assert service.found is not None
        first = (tmp_path / "logs" / "svc.log").read_text().splitlines()[0]
    finally:
        stop_service(service, grace_s=2.0)
    assert first == (f"cli from {(tree / 'microserving' / 'cli.py').resolve()} "
                     f"cwd {tree.resolve()} args ['--flag']")


def test_a_tree_without_the_project_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no microserving/cli.py"):
        start_service("svc", [], tmp_path / "logs", env={SERVICE_TREE_ENV: str(tmp_path / "empty")})


def test_ab_values_make_distinct_log_names() -> None:
    assert _label("true") == "true" and _label("0") == "0"
    paths = ["/srv/a/b", "/srv/a_b", "srv/a/b", "."]
    labels = [_label(value) for value in paths]
    assert len(set(labels)) == len(labels)
    assert all("/" not in label for label in labels)
