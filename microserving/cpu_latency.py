"""Keep the host's idle CPUs quick to wake while a service runs.

A request crosses several processes (client, gateway, router, shim, engine core, and back),
and at low load each crossing wakes a process whose CPU went idle. An idle CPU enters an idle
state whose exit costs time: a deep C-state on bare metal, a halted vCPU on a VM, where the
wake-up goes through the hypervisor and finds the CPU's caches cold. The development VM
(Firecracker) runs the haltpoll cpuidle driver with polling off (`guest_halt_poll_ns=0`); the
GPU hosts here run no cpuidle driver at all (`current_driver` none: the idle loop halts).

The remedy is the kernel's CPU latency QoS: while a process holds `/dev/cpu_dma_latency` open
with a bound written to it, the idle governor picks only states that wake within that many
microseconds (0: it polls instead of halting). The bound is system-wide, it lasts while the
file stays open (the process's life: the kernel drops it when the process exits, however it
exits), and one holder a host is enough. Where the kernel runs no cpuidle driver nothing reads
the bound; there a bound of 0 is kept by `IdlePollers` (one idle-priority spinning process a
CPU, the userspace form of `idle=poll`), and any other bound is refused, as are the pollers
under a cgroup CPU quota (their time would count against it). Either way it costs
what polling costs: idle CPUs stay busy from the host's point of view. Opening the file needs
root (or a device node made writable for the service); a service asked to hold a bound it
cannot hold fails at start with the reason rather than run without it (`CpuLatencyError`).
Figures: docs/throughput.md, "Idle CPUs that wake slowly".

No library offers this (tuned and the kernel's own pm_qos tools hold the same file from
outside the process); it is one open and one four-byte write, or a process a CPU.
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
from typing import Annotated

from pydantic import BeforeValidator, Field

logger = logging.getLogger(__name__)

PATH = "/dev/cpu_dma_latency"
# Which cpuidle driver the kernel runs ("none": the idle loop halts the CPU without asking
# any governor, and so without reading the bound: the GPU hosts here, run 29).
IDLE_DRIVER = "/sys/devices/system/cpu/cpuidle/current_driver"
# Where this process's cgroups are named and mounted: idle pollers are refused under a CPU
# quota, which their time would count against (throttling the service they are for).
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
# The largest bound the kernel takes (PM_QOS_RESUME_LATENCY_NO_CONSTRAINT is above it).
MAX_US = 2_000_000_000

# The settings' words for "hold no bound" (the field's default, None), for the environment and
# for side-by-side runs (`bench capacity --ab-env ... --ab-values off 0`).
_OFF = frozenset({"", "off", "none"})


def _off_as_none(value: object) -> object:
    return None if isinstance(value, str) and value.strip().lower() in _OFF else value


# The type of a service's `cpu_latency_us` setting: None (or "off") holds nothing.
CpuLatencySetting = Annotated[Annotated[int, Field(ge=0, le=MAX_US)] | None, BeforeValidator(_off_as_none)]


class CpuLatencyError(RuntimeError):
    """The bound could not be held (no such file, no permission, not Linux)."""


class CpuLatencyHold:
    """A held bound of `us` microseconds on the host's CPU wake-up latency; `close()` (or the
    process's exit) lets it go."""

    def __init__(self, us: int, path: str | None = None) -> None:
        path = PATH if path is None else path
        if not 0 <= us <= MAX_US:
            raise CpuLatencyError(f"a CPU latency bound must be in [0, {MAX_US}] us, not {us}")
        self.us = us
        self.path = path
        self._fd: int | None = None
        self._pollers: IdlePollers | None = None
        if idle_driver() == "none":
            # Nothing reads the bound here: 0 is kept by polling CPUs, nothing else can be.
            if us != 0:
                raise CpuLatencyError(
                    f"this host's kernel runs no cpuidle driver ({IDLE_DRIVER}: none), so nothing "
                    f"honours a CPU latency bound of {us} us; only 0 can be kept here (by idle "
                    "pollers, one a CPU)")
            quota = cpu_quota()
            if quota is not None:
                raise CpuLatencyError(
                    f"this host's kernel runs no cpuidle driver, so a bound of 0 needs idle "
                    f"pollers, and this process runs under a CPU quota ({quota}) that their time "
                    "would count against, throttling the service; lift the quota or leave the "
                    "setting unset")
            self._pollers = IdlePollers(sorted(os.sched_getaffinity(0)))
            logger.info("CPU latency bound 0 us: no cpuidle driver, %d idle pollers",
                        len(self._pollers.processes))
            return
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as error:
            raise CpuLatencyError(
                f"cannot hold a CPU latency bound of {us} us: {path}: {error.strerror} "
                "(it needs root or a device node writable by this service; leave the setting "
                "unset to run without it)"
            ) from None
        try:
            os.write(fd, struct.pack("=i", us))  # the kernel takes a native 32-bit integer
        except OSError as error:
            os.close(fd)
            raise CpuLatencyError(f"{path} refused the bound {us}: {error.strerror}") from None
        self._fd = fd
        logger.info("CPU latency bound %d us held (%s)", us, path)

    @property
    def poller_pids(self) -> list[int]:
        """The idle pollers that keep the bound (no cpuidle driver); none where the kernel's
        QoS keeps it."""
        return [] if self._pollers is None else [p.pid for p in self._pollers.processes]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._pollers is not None:
            self._pollers.close()
            self._pollers = None

    def __enter__(self) -> CpuLatencyHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# One poller: pinned to its CPU, at SCHED_IDLE (it runs only when nothing else on that CPU
# wants to, and any task that wakes there takes the CPU from it at once), killed with the
# process that started it (PR_SET_PDEATHSIG, and a look at its parent between spins), named
# `ms-idle-poll` in ps and top (PR_SET_NAME).
_POLLER = """
import ctypes, os, signal, sys
cpu, parent = int(sys.argv[1]), int(sys.argv[2])
libc = ctypes.CDLL(None)
libc.prctl(1, signal.SIGKILL)
libc.prctl(15, b"ms-idle-poll")
if os.getppid() != parent:
    sys.exit(0)
os.sched_setaffinity(0, {cpu})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while os.getppid() == parent:
    for _ in range(200_000):
        pass
"""


class IdlePollers:
    """Where the kernel runs no cpuidle driver, its idle loop halts a CPU whatever bound is
    held (on a VM: the vCPU exits to the hypervisor, and a wake-up has to bring it back).
    Keeping every CPU busy with an idle-priority spin is the userspace form of the kernel's
    `idle=poll`: a CPU never halts, and a task that wakes on it preempts the spin at once.
    What it costs is the kernel's polling's: each CPU shows busy to the host."""

    def __init__(self, cpus: list[int]) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []
        try:
            for cpu in cpus:
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-S", "-c", _POLLER, str(cpu), str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    # A session of their own: not in the service's process group, whose CPU
                    # `bench capacity` counts as the service's (run 30 counted them there).
                    close_fds=True, start_new_session=True))
        except OSError as error:
            self.close()
            raise CpuLatencyError(f"cannot start the idle pollers: {error.strerror}") from None

    def close(self) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait()
        self.processes = []


def cpu_quota() -> str | None:
    """This process's cgroup CPU quota as the kernel states it (cgroup v2 `cpu.max`, or v1
    `cpu.cfs_quota_us` and its period), or None where it has none (or none can be read)."""
    try:
        with open(PROC_CGROUP) as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        relative = path.lstrip("/")
        if hierarchy == "0" and not controllers:  # v2: one unified hierarchy
            text = _read(os.path.join(CGROUP_ROOT, relative, "cpu.max"))
            if text is not None and text.split()[0] != "max":
                return f"cpu.max {text}"
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            base = os.path.join(CGROUP_ROOT, controllers, relative)
            quota = _read(os.path.join(base, "cpu.cfs_quota_us"))
            if quota is not None and int(quota) > 0:
                return f"cpu.cfs_quota_us {quota} per {_read(os.path.join(base, 'cpu.cfs_period_us'))}"
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return None


def idle_driver() -> str | None:
    """The kernel's cpuidle driver ("none" where it runs none), or None where it says nothing."""
    return _read(IDLE_DRIVER)


# The holds of hold(): kept for the process's life (its exit lets the bound go and kills the
# pollers), never collected.
_HELD: list[CpuLatencyHold] = []


def hold(us: int | None, path: str | None = None) -> CpuLatencyHold | None:
    """Hold what a service's `cpu_latency_us` setting asks for (None: nothing) until the
    process exits."""
    if us is None:
        return None
    held = CpuLatencyHold(us, path)
    _HELD.append(held)
    return held


def hold_for_service(us: int | None, prog: str) -> bool:
    """A service's start: hold what its setting asks for (hold()), or say on stderr why it
    cannot (`prog: reason`) and return False, so the service exits before it serves."""
    try:
        hold(us)
    except CpuLatencyError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return False
    return True


def current(path: str | None = None) -> int:
    """The host's bound in force now (the least of all held), microseconds."""
    with open(PATH if path is None else path, "rb") as file:
        (value,) = struct.unpack("=i", file.read(4))
    return int(value)
