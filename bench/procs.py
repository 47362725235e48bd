"""Start the project's real entry points (`python -m microserving.cli ...`) as subprocesses for
benchmarks, each logging to a file of its own (microserving.stack.process launches them), and
stop them all on exit (no orphans)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from microserving.stack.process import LISTENING, ServiceProcess

# `microserving up`'s `http://HOST:PORT/v1`.
BASE_URL = re.compile(r"(?P<url>https?://[^\s]+/v1)\b")


def start_service(
    name: str,
    args: list[str],
    log_dir: Path,
    *,
    pattern: re.Pattern[str] = LISTENING,
    timeout_s: float = 300.0,
    module: str = "microserving.cli",
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    """`python -m MODULE ARGS` in its own process group (environment: ours, or `env`); waits
    until it prints its address."""
    log_dir.mkdir(parents=True, exist_ok=True)
    service = ServiceProcess(
        name, [sys.executable, "-m", module, *args], log_path=log_dir / f"{name}.log",
        pattern=pattern, env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
    )
    service.wait_listening(timeout_s)
    return service


def stop_service(service: ServiceProcess, grace_s: float = 10.0) -> None:
    """SIGTERM the service, then SIGKILL its process group after grace_s."""
    service.stop(grace_s)


class ServiceGroup:
    """Services started together and stopped in reverse order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.services: list[ServiceProcess] = []

    def start(self, name: str, args: list[str], **kwargs: object) -> ServiceProcess:
        service = start_service(name, args, self.log_dir, **kwargs)  # type: ignore[arg-type]
        self.services.append(service)
        return service

    def stop(self, service: ServiceProcess) -> None:
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

