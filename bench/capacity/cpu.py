"""CPU seconds from /proc (Linux): of a process group (a service and any workers it forks),
of one thread (the synthetic engine's, to take it out of its shim's serving CPU), and of the
whole machine."""

from __future__ import annotations

import os
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PROC = Path("/proc")


def _stat_fields(path: Path) -> list[str] | None:
    """Fields after the command name (which may hold spaces): state is [0], utime [11]."""
    try:
        text = path.read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None  # the process or thread is gone
    return text[text.rindex(")") + 2 :].split()


def _cpu_s(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime + stime, every thread


def group_cpu_s(pgid: int) -> float:
    """User + system seconds of every live process in process group `pgid`."""
    total = 0.0
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry / "stat")
        if fields is not None and int(fields[2]) == pgid:
            total += _cpu_s(fields)
    return total


def process_cpu_s(pid: int) -> float:
    """User + system seconds of one process, all its threads (0 once it is gone)."""
    fields = _stat_fields(_PROC / str(pid) / "stat")
    return 0.0 if fields is None else _cpu_s(fields)


def thread_cpu_s(tid: int) -> float:
    """User + system seconds of one thread, in whichever process it lives (a shim's engine
    loop runs in the shim or in its engine core process): /proc/TID/task/TID names it."""
    fields = _stat_fields(_PROC / str(tid) / "task" / str(tid) / "stat")
    return 0.0 if fields is None else _cpu_s(fields)


def machine_busy_s() -> float:
    """Non-idle CPU seconds of the machine, all cores added (from /proc/stat)."""
    values = [int(v) for v in (_PROC / "stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / _CLK_TCK
