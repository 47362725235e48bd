"""`microserving <service>` defaults gRPC to its iomgr I/O stack before gRPC starts
(microserving/grpc_io.py): seen in the environment a real gateway hands its worker processes;
a GRPC_EXPERIMENTS the caller set wins; a process that imported gRPC already is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from microserving import grpc_io
from tests.reliability.stack_procs import (
    REPO,
    clean_env,
    launch,
    stop_all,
    until,
    wait_listening,
    worker_pids,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _worker_environ(pid: int) -> dict[str, str]:
    """The environment one of the gateway's worker processes started with."""
    assert until(lambda: bool(worker_pids(pid))), "no worker process came up"
    raw = Path(f"/proc/{worker_pids(pid)[0]}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.e2e
def test_a_service_runs_on_the_legacy_io_stack_unless_told_otherwise(tmp_path: Path) -> None:
    if grpc_io.ENV in os.environ:
        pytest.skip(f"{grpc_io.ENV} is set for this test run: the services inherit it")
    args = ["gateway", "--router", "127.0.0.1:9", "--port", "0", "--workers", "2"]
    default = launch("gateway-default", args, tmp_path)
    chosen = launch("gateway-chosen", args, tmp_path, {grpc_io.ENV: "event_engine_client"})
    try:
        wait_listening([default, chosen])
        assert _worker_environ(default.pid).get(grpc_io.ENV) == grpc_io.LEGACY_IO
        assert _worker_environ(chosen.pid).get(grpc_io.ENV) == "event_engine_client"
    finally:
        stop_all([default, chosen])


def test_the_default_applies_only_before_grpc_and_never_over_the_callers_choice() -> None:
    script = ("import os\n"
              "from microserving import grpc_io\n"
              "print(grpc_io.prefer_legacy_io(), os.environ.get('GRPC_EXPERIMENTS'))\n")

    def run(code: str, env: dict[str, str]) -> list[str]:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, cwd=REPO, timeout=60, check=True).stdout.split()

    env = {k: v for k, v in clean_env().items() if k != grpc_io.ENV}
    assert run(script, env) == ["True", grpc_io.LEGACY_IO]
    assert run("import grpc\n" + script, env) == ["False", "None"]
    assert run(script, {**env, grpc_io.ENV: "event_engine_client"}) == ["False", "event_engine_client"]
