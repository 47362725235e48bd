"""Start the project's real entry points (`python -m microserving.cli ...`) as subprocesses for
benchmarks, read the address each prints, and stop them all on exit (no orphans)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# `microserving shim|router|gateway listening on HOST:PORT` and `up`'s `http://HOST:PORT/v1`.
LISTENING = re.compile(r"listening on (?P<host>\[[^\]]+\]|[^\s:]+):(?P<port>\d+)")
BASE_URL = re.compile(r"(?P<url>https?://[^\s]+/v1)\b")


@dataclass
class Service:
    """A started entry point: its process, the first match of its address pattern, its log."""

    name: str
    process: subprocess.Popen[str]
    log_path: Path
    found: re.Match[str] | None = None
    lines: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        if self.found is None:
            raise RuntimeError(f"{self.name}: no address printed")
        return f"{self.found['host']}:{self.found['port']}"


def _pump(service: Service, pattern: re.Pattern[str], ready: threading.Event) -> None:
    """Copy the child's output to its log; note the first line matching `pattern`."""
    assert service.process.stdout is not None  # Popen(stdout=PIPE) below
    with service.log_path.open("w", encoding="utf-8") as log:
        for line in service.process.stdout:
            log.write(line)
            log.flush()
            service.lines.append(line)
            del service.lines[:-50]
            if service.found is None and (match := pattern.search(line)):
                service.found = match
                ready.set()
    ready.set()  # the process ended


def start_service(
    name: str,
    args: list[str],
    log_dir: Path,
    *,
    pattern: re.Pattern[str] = LISTENING,
    timeout_s: float = 300.0,
    module: str = "microserving.cli",
) -> Service:
    """`python -m MODULE ARGS` in its own process group; waits until it prints its address."""
    log_dir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    service = Service(name, process, log_dir / f"{name}.log")
    ready = threading.Event()
    threading.Thread(target=_pump, args=(service, pattern, ready), daemon=True).start()
    if not ready.wait(timeout_s) or service.found is None:
        stop_service(service)
        tail = "".join(service.lines[-15:])
        raise RuntimeError(f"{name} did not start (see {service.log_path}):\n{tail}")
    return service


def stop_service(service: Service, grace_s: float = 10.0) -> None:
    """SIGTERM the service's process group, then SIGKILL what is left after grace_s."""
    if service.process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(service.process.pid, signal.SIGTERM)
    try:
        service.process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(service.process.pid, signal.SIGKILL)
        service.process.wait(5)


class ServiceGroup:
    """Services started together and stopped in reverse order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.services: list[Service] = []

    def start(self, name: str, args: list[str], **kwargs: object) -> Service:
        service = start_service(name, args, self.log_dir, **kwargs)  # type: ignore[arg-type]
        self.services.append(service)
        return service

    def stop(self, service: Service) -> None:
        stop_service(service)
        self.services.remove(service)

    def close_matching(self, suffix: str) -> None:
        """Stop the services whose name ends in `suffix` (a partly started stack)."""
        for service in [s for s in self.services if s.name.endswith(suffix)]:
            self.stop(service)

    def close(self) -> None:
        for service in reversed(self.services):
            stop_service(service)
        self.services.clear()


@contextlib.contextmanager
def service_group(log_dir: Path) -> Iterator[ServiceGroup]:
    group = ServiceGroup(log_dir)
    try:
        yield group
    finally:
        group.close()

