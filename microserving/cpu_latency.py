"""Keep the host's idle CPUs quick to wake while a service runs (Linux PM QoS).

A request crosses several processes (client, gateway, router, shim, engine core, and back),
and at low load each crossing wakes a process whose CPU went idle. An idle CPU enters an
idle state whose exit costs time: a deep C-state on bare metal, a halted vCPU on a VM (the
development VM and the GPU hosts here are Firecracker guests whose idle driver halts at once,
`haltpoll.guest_halt_poll_ns=0`): every wake-up then goes through the hypervisor and finds
the CPU's caches cold. Measured on the 2-core development VM (`bench capacity`, one stream,
round-robin, synthetic engine): the first token +4.03 ms over the schedule, +2.82 ms with
the latency bound below held at 0, and the stack's CPU per token a third lower (docs/throughput.md,
"Idle CPUs that wake slowly").

The remedy is the kernel's CPU latency QoS: while a process holds `/dev/cpu_dma_latency`
open with a bound written to it, the idle governor picks only states that wake within that
many microseconds (0: it polls instead of halting). The bound is system-wide, it lasts while
the file stays open (the process's life: the kernel drops it when the process exits, however
it exits), and one holder a host is enough. It costs what polling costs: idle CPUs stay
busy from the host's point of view. Opening the file needs root (or a device node made
writable for the service); a service asked to hold a bound it cannot hold fails at start
with the reason rather than run without it (`CpuLatencyError`).

No library offers this (tuned and the kernel's own pm_qos tools hold the same file from
outside the process); it is one open and one four-byte write.
"""

from __future__ import annotations

import os
import struct
from typing import Annotated

from pydantic import BeforeValidator, Field

PATH = "/dev/cpu_dma_latency"
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
        self.us = us
        self.path = path
        self._fd: int | None = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> CpuLatencyHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hold(us: int | None, path: str | None = None) -> CpuLatencyHold | None:
    """The hold a service's `cpu_latency_us` setting asks for (None: none). Nothing closes
    its descriptor but close() and the process's exit (no finalizer): a service that holds
    the bound for its whole life need not keep the result."""
    return None if us is None else CpuLatencyHold(us, path)


def current(path: str | None = None) -> int:
    """The host's bound in force now (the least of all held), microseconds."""
    with open(PATH if path is None else path, "rb") as file:
        (value,) = struct.unpack("=i", file.read(4))
    return int(value)
