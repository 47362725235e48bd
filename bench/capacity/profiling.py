"""Profiles of the control plane while a cell runs: `py-spy record` on every process of the
stack (gateway workers included, `--subprocesses`), in raw (collapsed-stack) text that
`bench.capacity.profiling.summary` folds into the functions that take the time."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from bench.capacity.stack import Stack


def start_profiles(stack: Stack, out_dir: Path, tag: str, duration_s: float,
                   extra_args: Sequence[str] = ()) -> list[subprocess.Popen[bytes]]:
    """One `py-spy record` per process, running `duration_s` in the background (none when
    py-spy is not installed: the bench carries on without)."""
    found = [record(process.service.process.pid, out_dir / f"profile-{tag}-{process.name}.txt",
                    duration_s, extra_args) for process in stack.processes]
    return [profiler for profiler in found if profiler is not None]


def record(pid: int, path: Path, duration_s: float,
           extra_args: Sequence[str] = ()) -> subprocess.Popen[bytes] | None:
    """`py-spy record` of process `pid` and its children in the background, into `path` (None
    when py-spy is not installed). `extra_args`, e.g. --idle or --native (which needs the
    process paused at each sample, so it drops --nonblocking)."""
    py_spy = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if py_spy is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    pausing = [] if "--native" in extra_args else ["--nonblocking"]
    return subprocess.Popen(
        [py_spy, "record", "--pid", str(pid), "--subprocesses", "--duration",
         str(max(1, round(duration_s))), "--rate", "200", "--format", "raw", *pausing,
         *extra_args, "--output", str(path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summary(path: Path, top: int = 25, only: str = "") -> str:
    """The functions with the most samples, by their own (self) and with callees (inclusive);
    `only`: just the stacks with a frame that contains it (e.g. "spawn_main": a shim's engine
    core process, which py-spy records with the shim)."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or only not in stack:
            continue
        samples = int(count)
        total += samples
        frames = stack.split(";")
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    which = f" (stacks with {only!r})" if only else ""
    lines = [f"{path.name}{which}: {total} samples", "self:"]
    lines += [f"  {100 * n / total:5.1f}% {f}" for f, n in own.most_common(top)]
    lines += ["inclusive:"] + [f"  {100 * n / total:5.1f}% {f}" for f, n in inclusive.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="py-spy raw profiles, summarized")
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--only", default="", help="only the stacks with a frame containing this")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for name in args.files:
        print(summary(name, args.top, args.only))
