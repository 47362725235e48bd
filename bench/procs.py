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


# A service's environment naming a source tree (a checkout or `git archive` of another
# revision): the service runs that tree's code, started from its root, while the benchmark,
# its load and its yardsticks stay this tree's. `bench capacity --ab-env
# MICROSERVING_BENCH_SERVICE_TREE --ab-values DIR .` compares two revisions' services side by
# side under one benchmark (two benchmarks of their own differ in more than the services).
SERVICE_TREE_ENV = "MICROSERVING_BENCH_SERVICE_TREE"


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
    until it prints its address. With SERVICE_TREE_ENV set in that environment, MODULE is
    that tree's (started from its root, which `-m` puts first on the path); paths in ARGS
    must then be absolute."""
    log_dir.mkdir(parents=True, exist_ok=True)
    environment = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    tree = service_tree(environment)
    if tree is not None:
        environment["PYTHONPATH"] = os.pathsep.join(
            [str(tree), *filter(None, [environment.get("PYTHONPATH")])])
    service = ServiceProcess(
        name, [sys.executable, "-m", module, *args], log_path=log_dir / f"{name}.log",
        pattern=pattern, env=environment, cwd=tree,
    )
    service.wait_listening(timeout_s)
    return service


def service_tree(env: dict[str, str]) -> Path | None:
    """The source tree SERVICE_TREE_ENV names (resolved), or None; a ValueError where it
    names no tree with the project's packages in it."""
    value = env.get(SERVICE_TREE_ENV, "").strip()
    if not value:
        return None
    tree = Path(value).resolve()
    if not (tree / "microserving" / "cli.py").is_file():
        raise ValueError(f"{SERVICE_TREE_ENV}={value}: no microserving/cli.py there (a checkout "
                         "or `git archive` of the project is expected)")
    return tree


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

