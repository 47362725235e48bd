"""The process launcher every launcher uses (microserving/stack/process.py), on small real
child processes: the address from the `listening on` line (from a log file or relayed
output), a clear failure with the child's output, and a stop that leaves nothing behind."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from microserving.stack.process import ServiceProcess, StartFailed, free_port, free_ports

pytestmark = pytest.mark.unit

# Prints some lines, then the address line, then sleeps until told to stop.
_SERVES = (
    "import sys, time\n"
    "print('loading', flush=True)\n"
    "print('oops on stderr', file=sys.stderr, flush=True)\n"
    "print('demo listening on 127.0.0.1:4321 (extra)', flush=True)\n"
    "time.sleep(600)\n"
)
# Starts a grandchild in the same process group, prints both pids, ignores SIGTERM.
_STUBBORN_PARENT = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(f'pids {child.pid} listening on 127.0.0.1:1', flush=True)\n"
    "time.sleep(600)\n"
)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")  # a zombie has ended


def test_the_address_comes_from_the_log_file_and_stop_ends_the_service(tmp_path: Path) -> None:
    service = ServiceProcess("demo", _python(_SERVES), log_path=tmp_path / "demo.log")
    assert service.wait_listening(timeout_s=60) == "127.0.0.1:4321"
    assert "oops on stderr" in service.output() and "loading" in service.output()
    assert service.stop(grace_s=10) == -15  # SIGTERM
    assert not service.is_alive()


def test_without_a_log_file_every_line_is_relayed_and_the_address_found(tmp_path: Path) -> None:
    lines: list[str] = []
    exited = threading.Event()
    service = ServiceProcess("demo", _python(_SERVES), on_line=lines.append,
                             on_exit=lambda _: exited.set())
    try:
        assert service.wait_listening(timeout_s=60) == "127.0.0.1:4321"
        assert lines[:2] == ["loading\n", "oops on stderr\n"]  # stderr shares the pipe, in order
    finally:
        service.stop(grace_s=10)
    assert exited.wait(10)


def test_a_process_that_exits_before_listening_fails_with_its_output(tmp_path: Path) -> None:
    code = "import sys; print('bad flag --nope'); sys.exit(3)"
    service = ServiceProcess("broken", _python(code), log_path=tmp_path / "broken.log")
    with pytest.raises(StartFailed, match=r"(?s)broken did not start: exited with code 3.*bad flag --nope"):
        service.wait_listening(timeout_s=60)


def test_a_process_that_never_listens_is_stopped_after_the_timeout(tmp_path: Path) -> None:
    service = ServiceProcess("silent", _python("import time; time.sleep(600)"), on_line=lambda _: None)
    started = time.monotonic()
    with pytest.raises(StartFailed, match="not listening after"):
        service.wait_listening(timeout_s=0.5)
    assert time.monotonic() - started < 30
    assert not service.is_alive()


def test_stop_kills_what_ignores_sigterm_and_what_it_started(tmp_path: Path) -> None:
    service = ServiceProcess("stubborn", _python(_STUBBORN_PARENT), log_path=tmp_path / "s.log")
    service.wait_listening(timeout_s=60)
    grandchild = int(service.output().split()[1])
    assert _is_running(grandchild)
    service.stop(grace_s=0.5)
    assert not service.is_alive()
    deadline = time.monotonic() + 10
    while _is_running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _is_running(grandchild)


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
