"""Which of gRPC core's I/O stacks the stack's processes use.

grpcio 1.85 moves sockets through its EventEngine by default; its older iomgr stack is still
selectable with the `GRPC_EXPERIMENTS` switches below. One message there and back between two
processes over a bidi stream (grpc.aio on uvloop, the development VM, medians of 500, several
runs alternating): 151-237 us back to back and 205-409 us after a 2 ms pause with EventEngine,
83-101 us and 136-254 us without it (plain asyncio TCP: 18-24 us), and in `bench capacity`,
every stack process with one or the other, taking turns (docs/throughput.md, "gRPC's I/O
stack"): at one stream, in every round, the first token round-robin +3.60 -> +3.11 ms and
disagg +5.65 -> +4.60 ms, the control plane's CPU per 1,000 tokens about 550 -> 405 ms; at 64
streams no difference beyond the VM's spread (disagg over five rounds each: 0.78-0.87 of
nominal without EventEngine, 0.78-0.85 with it).

`microserving <service>` sets this default before gRPC starts; a `GRPC_EXPERIMENTS` already in
the environment wins (`GRPC_EXPERIMENTS=event_engine_client,event_engine_listener` keeps
EventEngine). A gRPC that no longer knows the names logs "Unknown experiment" once and goes
on with its own default.
"""

from __future__ import annotations

import os
import sys

ENV = "GRPC_EXPERIMENTS"
LEGACY_IO = "-event_engine_client,-event_engine_listener"


def prefer_legacy_io() -> bool:
    """Default the process (and the processes it starts) to gRPC's iomgr stack; whether the
    default applies here: not where the environment names experiments already, nor where
    gRPC was imported before (its core may have read the environment then)."""
    if ENV in os.environ or "grpc" in sys.modules:
        return False
    os.environ[ENV] = LEGACY_IO
    return True
