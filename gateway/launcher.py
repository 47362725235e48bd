"""Child processes of `microserving up`: each in its own process group (so a stop reaches its
children too), its output relayed line by line with a name prefix, its announced address
("... listening on HOST:PORT") captured, and stopped by SIGTERM then SIGKILL after a grace."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

_LISTENING = re.compile(r"listening on (\S+:\d+)")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: new session, and SIGTERM if the launcher dies (Linux)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ManagedProcess:
    def __init__(self, name: str, argv: list[str], on_exit: Callable[[ManagedProcess], None],
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.address: str | None = None
        self.announced = threading.Event()
        self._on_exit = on_exit
        self._proc = subprocess.Popen(  # noqa: S603 - argv built by the launcher
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, bufsize=1, preexec_fn=_die_with_parent, env=env)
        threading.Thread(target=self._relay, name=f"{name}-output", daemon=True).start()
        threading.Thread(target=self._watch, name=f"{name}-wait", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    def _relay(self) -> None:
        assert self._proc.stdout is not None  # opened as a pipe above
        for line in self._proc.stdout:
            match = _LISTENING.search(line)
            if match and self.address is None:
                self.address = match.group(1)
                self.announced.set()
            sys.stderr.write(f"[{self.name}] {line}")
            sys.stderr.flush()

    def _watch(self) -> None:
        self._proc.wait()
        self.announced.set()  # wake anyone waiting for an address that will never come
        self._on_exit(self)

    def stop(self, grace_s: float) -> None:
        """SIGTERM to the whole group; SIGKILL what is left after `grace_s`."""
        if self._proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                sys.stderr.write(f"microserving up: {self.name} ignored SIGTERM; killing it\n")
        self._signal(signal.SIGKILL)  # stragglers in the group
        self._proc.wait()

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signum)
