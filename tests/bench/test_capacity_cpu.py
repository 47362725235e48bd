"""bench capacity's view of the busy cores outside the stack: every process's CPU from /proc,
the busiest outside the excluded process groups, and the interrupts' share."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.capacity.cpu import busiest_others, machine_irq_s, processes_cpu_s

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_processes_cpu_s_names_this_process():
    name, pgid, started, cpu_s = processes_cpu_s()[os.getpid()]
    assert name.startswith(("python", "pytest"))
    assert pgid == os.getpgid(0)
    assert started > 0
    assert cpu_s > 0


def test_busiest_others_finds_a_spinning_process_and_leaves_out_excluded_groups():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(0.3)  # running before the window opens
        opened, start = processes_cpu_s(), time.perf_counter()
        time.sleep(1.0)
        closed, window_s = processes_cpu_s(), time.perf_counter() - start
    finally:
        spinner.kill()
        spinner.wait()
    rows = busiest_others(opened, closed, window_s, excluded_groups=set())
    spinning = [row for row in rows if row["pid"] == spinner.pid]
    # However loaded the machine, a spinning process gets some of a core in a second; the
    # bound is far below what it gets alone (about 1.0) and far above nothing.
    assert spinning and 0.05 < float(spinning[0]["cores"]) <= 1.05
    assert rows == sorted(rows, key=lambda row: -float(row["cores"]))
    excluded = busiest_others(opened, closed, window_s, excluded_groups={spinner.pid})
    assert all(row["pid"] != spinner.pid for row in excluded)


def test_busiest_others_counts_a_reused_pid_from_zero():
    opened = {10: ("old", 10, 500, 40.0)}
    closed = {10: ("new", 10, 900, 0.5), 11: ("steady", 11, 100, 3.0)}
    steady_before = {**opened, 11: ("steady", 11, 100, 2.0)}
    rows = busiest_others(steady_before, closed, 2.0, excluded_groups=set())
    assert rows == [{"pid": 11, "name": "steady", "cores": 0.5}, {"pid": 10, "name": "new", "cores": 0.25}]
    assert busiest_others(steady_before, closed, 2.0, excluded_groups={10, 11}) == []


def test_machine_irq_s_does_not_go_back():
    first = machine_irq_s()
    assert first >= 0
    assert machine_irq_s() >= first
