"""One service as a child process: started in a session of its own, its address read from the
`... listening on HOST:PORT` line every entry point prints once it serves, and stopped by
SIGTERM, then SIGKILL to its whole process group after a grace period (nothing it started
outlives it). `microserving up`, the benchmarks and the tests all start processes here."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

# `microserving shim|router|gateway listening on HOST:PORT`; HOST may hold colons (IPv6).
LISTENING = re.compile(r"listening on (?P<host>\S+):(?P<port>\d+)")
_POLL_S = 0.05  # reading a log file for the address: nothing to await but the child's write
_NUM_TAIL_LINES = 50
_PR_SET_PDEATHSIG = 1


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` different ports the OS reports free on `host` now (another process may take
    one before use: prefer port 0 where the service can report what it bound)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as held:  # all bound at once, so all different
        sockets = [held.enter_context(socket.socket(family, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def _die_with_parent() -> None:
    """Runs in the child before exec: a new session, and SIGTERM when the thread that started
    it ends (Linux), so a launcher killed outright leaves no service behind."""
    os.setsid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class StartFailed(RuntimeError):
    """The process ended, or the time ran out, before it printed its address."""


class ServiceProcess:
    """A started service. Its output (stdout and stderr together) goes either to `log_path`,
    written by the child itself (so the file is complete the moment the child wrote it), or,
    when there is no log file, line by line to `on_line` from a reader thread (e.g. relayed to
    the console). `pattern` finds the address line; `found` is its match."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path | None = None,
        on_line: Callable[[str], None] | None = None,
        pattern: re.Pattern[str] = LISTENING,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        on_exit: Callable[[ServiceProcess], None] | None = None,
        dies_with_parent: bool = False,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.pattern = pattern
        self.found: re.Match[str] | None = None
        self.announced = threading.Event()  # set once the address is found or the process ended
        self._tail: list[str] = []
        self._on_line = on_line
        self._on_exit = on_exit
        self._reader: threading.Thread | None = None
        self.process = self._popen(env, cwd, dies_with_parent)
        if log_path is None:
            self._reader = threading.Thread(target=self._read_output, name=f"{name}-output", daemon=True)
            self._reader.start()
        if on_exit is not None:
            threading.Thread(target=self._watch_exit, name=f"{name}-wait", daemon=True).start()

    def _popen(self, env: Mapping[str, str] | None, cwd: Path | None,
               dies_with_parent: bool) -> subprocess.Popen[str]:
        # start_new_session and preexec_fn both make a session; the second also sets the
        # death signal (and is unsafe in a threaded parent, so only on request).
        session = {"preexec_fn": _die_with_parent} if dies_with_parent else {"start_new_session": True}
        output = self.log_path.open("w", encoding="utf-8") if self.log_path else None
        try:
            return subprocess.Popen(  # noqa: S603 - argv built by the caller, no shell
                self.argv, stdout=output or subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, text=True, bufsize=1, cwd=cwd,
                env=dict(env) if env is not None else None, **session,  # type: ignore[arg-type]
            )
        finally:
            if output is not None:
                output.close()  # the child holds its own descriptor

    # ---- what it is ----
    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def is_alive(self) -> bool:
        return self.process.poll() is None

    @property
    def is_listening(self) -> bool:
        return self.found is not None

    @property
    def address(self) -> str:
        """HOST:PORT from the address line (a pattern without those groups: the whole match)."""
        if self.found is None:
            raise RuntimeError(f"{self.name}: no address printed")
        groups = self.found.groupdict()
        if "host" in groups and "port" in groups:
            return f"{groups['host']}:{groups['port']}"
        return self.found.group(0)

    def output(self) -> str:
        """Everything it printed so far (its log file), or the last lines read from it."""
        if self.log_path is not None:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        if self._reader is not None and not self.is_alive():
            self._reader.join(timeout=5)  # the last lines it wrote before it ended
        return "".join(self._tail)

    # ---- start ----
    def wait_listening(self, timeout_s: float) -> str:
        """Its address once it printed it; stops it and raises StartFailed (with the end of
        its output) if it ends or `timeout_s` passes first."""
        deadline_s = time.monotonic() + timeout_s
        while self.found is None:
            if self.log_path is not None:
                self._scan_log()
            else:
                self.announced.wait(max(0.0, min(_POLL_S, deadline_s - time.monotonic())))
            if self.found is not None:
                break
            if not self.is_alive() or time.monotonic() > deadline_s:
                why = f"exited with code {self.returncode}" if not self.is_alive() else f"not listening after {timeout_s:.0f} s"
                self.stop(grace_s=5.0)
                where = f" (log: {self.log_path})" if self.log_path else ""
                raise StartFailed(f"{self.name} did not start: {why}{where}; its output ends:\n{self.output()[-3000:]}")
            if self.log_path is not None:
                time.sleep(_POLL_S)
        return self.address

    def _scan_log(self) -> None:
        match = self.pattern.search(self.output())
        if match is not None:
            self.found = match
            self.announced.set()

    def _read_output(self) -> None:
        assert self.process.stdout is not None  # a pipe when there is no log file
        for line in self.process.stdout:
            self._tail.append(line)
            del self._tail[:-_NUM_TAIL_LINES]
            if self.found is None and (match := self.pattern.search(line)):
                self.found = match
                self.announced.set()
            if self._on_line is not None:
                self._on_line(line)
        self.announced.set()  # wake anyone waiting for an address that will never come

    def _watch_exit(self) -> None:
        self.process.wait()
        if self._reader is not None:
            self._reader.join()
        self.announced.set()
        assert self._on_exit is not None  # the thread runs only for it
        self._on_exit(self)

    # ---- stop, and faults for tests ----
    def stop(self, grace_s: float = 15.0) -> int:
        """SIGTERM (it stops what it started), then SIGKILL to its whole process group after
        `grace_s` and for any straggler; returns its exit code."""
        if self.is_alive():
            self.resume()  # a paused process could not act on SIGTERM
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                sys.stderr.write(f"{self.name} ignored SIGTERM for {grace_s:.0f} s; killing it\n")
        self._signal_group(signal.SIGKILL)
        return self.process.wait()

    def kill(self, *, whole_group: bool = False) -> None:
        """SIGKILL the process (a crash, for tests: what it started is not told, unless
        `whole_group`, which also ends those), and reap it."""
        if self.is_alive():
            # No SIGCONT first: SIGKILL ends a stopped process too, and a frozen engine let run
            # for a moment before it dies answers requests a test froze it to keep from it.
            self.process.kill()
        if whole_group:
            self._signal_group(signal.SIGKILL)
        self.process.wait(timeout=30)

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)
