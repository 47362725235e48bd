"""Starts `microserving up` as a subprocess, as a user would, and reads what it announces
(the base URL on stdout; each child's pid and address on stderr)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_READY = re.compile(r"ready at (http://\S+)")
_STARTED = re.compile(r"microserving up: started (\S+) \(pid (\d+)\)")
_CHILD_READY = re.compile(r"microserving up: (\S+) ready on (\S+) ")


@dataclass
class UpStack:
    process: subprocess.Popen[str]
    base_url: str
    log_path: Path
    pids: dict[str, int] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_addresses(self) -> list[str]:
        return [a for name, a in self.addresses.items() if name not in ("router", "gateway")]

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)


def start_up(*args: str, timeout_s: float = 240.0) -> UpStack:
    log = Path(tempfile.mkstemp(prefix="microserving-up-", suffix=".log")[1])
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "microserving.cli", "up", "--port", "0", "--router-port", "0",
         "--startup-timeout-s", str(timeout_s),
         *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    assert process.stdout is not None
    deadline_s = time.monotonic() + timeout_s
    base_url = None
    for line in process.stdout:  # the only stdout line is the ready line
        match = _READY.search(line)
        if match:
            base_url = match.group(1)
            break
        if time.monotonic() > deadline_s:
            break
    if base_url is None:
        process.kill()
        raise RuntimeError(f"microserving up did not become ready:\n{log.read_text()[-4000:]}")
    stack = UpStack(process, base_url, log)
    text = stack.log()
    stack.pids = {name: int(pid) for name, pid in _STARTED.findall(text)}
    stack.addresses = dict(_CHILD_READY.findall(text))
    return stack
