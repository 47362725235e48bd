"""CPU seconds from /proc (Linux): of a process group (a service and any workers it forks),
of one thread (the synthetic engine's, to take it out of its shim's serving CPU), and of the
whole machine."""

from __future__ import annotations

import os
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PROC = Path("/proc")


def _stat(path: Path) -> tuple[str, list[str]] | None:
    """The command name (which may hold spaces) and the fields after it: state is [0],
    process group [2], utime [11], start time [19]; None once the process or thread is gone."""
    try:
        text = path.read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    end = text.rindex(")")
    return text[text.index("(") + 1 : end], text[end + 2 :].split()


def _stat_fields(path: Path) -> list[str] | None:
    stat = _stat(path)
    return None if stat is None else stat[1]


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


def _machine_ticks() -> list[int]:
    """/proc/stat's first line, all cores added: user, nice, system, idle, iowait, irq,
    softirq, steal, ... in clock ticks."""
    return [int(v) for v in (_PROC / "stat").read_text().splitlines()[0].split()[1:]]


def machine_busy_s() -> float:
    """Non-idle CPU seconds of the machine, all cores added (from /proc/stat)."""
    values = _machine_ticks()
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / _CLK_TCK


# (command name, process group, start time in clock ticks, user + system seconds) of one
# process; the start time tells a pid reused in the window (a kernel worker's name changes
# with its work, so the name cannot).
ProcessCpu = tuple[str, int, int, float]


def processes_cpu_s() -> dict[int, ProcessCpu]:
    """Every live process's CPU so far, by pid, in one pass over /proc: what a cell's busy
    cores outside the stack and the client were (`other_processes`)."""
    out: dict[int, ProcessCpu] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(entry / "stat")
        if stat is not None:
            name, fields = stat
            out[int(entry.name)] = (name, int(fields[2]), int(fields[19]), _cpu_s(fields))
    return out


def machine_irq_s() -> float:
    """Seconds the machine's CPUs spent serving hardware and software interrupts (/proc/stat
    irq + softirq), the loopback network's receive work among them. Where the kernel accounts
    interrupt time apart (CONFIG_IRQ_TIME_ACCOUNTING) no process's counters hold it, so it is
    part of the busy cores outside the stack; elsewhere it is also in the process it
    interrupted (on the development VM: other_busy_cores about 0 with irq_cores 0.06)."""
    values = _machine_ticks()
    return (values[5] + values[6]) / _CLK_TCK


def busiest_others(
    opened: dict[int, ProcessCpu], closed: dict[int, ProcessCpu], window_s: float,
    excluded_groups: set[int], top: int = 5, min_cores: float = 0.02,
) -> list[dict[str, float | int | str]]:
    """The processes outside `excluded_groups` (the stack's services, the load's own group)
    that were busiest between the two snapshots: pid, name and cores, busiest first. A
    process born in the window counts from zero."""
    rows: list[dict[str, float | int | str]] = []
    for pid, (name, pgid, started, cpu_after) in closed.items():
        if pgid in excluded_groups:
            continue
        before = opened.get(pid)
        cpu_before = before[3] if before is not None and before[2] == started else 0.0
        cores = (cpu_after - cpu_before) / window_s
        if cores >= min_cores:
            rows.append({"pid": pid, "name": name, "cores": round(cores, 3)})
    rows.sort(key=lambda row: -float(row["cores"]))
    return rows[:top]
