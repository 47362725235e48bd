"""The floor under every hop: CPU a small message costs when one process sends it to
another over a local socket and the other answers (TCP loopback with TCP_NODELAY, or a Unix
socket pair with UNIX=1). Prints the round trip and each side's CPU per message (getrusage),
which includes the syscalls and the wake-ups of the other side.

    python3 socket_round_trip.py; UNIX=1 python3 socket_round_trip.py
"""

from __future__ import annotations

import os
import resource
import socket
import time

N = 20_000


def cpu_s(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    server = None
    if os.environ.get("UNIX"):
        mine, theirs = socket.socketpair(socket.AF_UNIX)
    else:
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(1)
    pid = os.fork()
    if pid == 0:  # the echoing side
        if server is not None:
            peer = socket.create_connection(server.getsockname())
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            peer = theirs
        for _ in range(N):
            peer.send(peer.recv(100))
        os._exit(0)
    if server is not None:
        mine, _ = server.accept()
        mine.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(N):
        mine.send(b"x" * 64)
        mine.recv(100)
    elapsed, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    os.waitpid(pid, 0)
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"round trip {elapsed / N * 1e6:.1f} us; CPU per message: this side "
          f"{(cpu_s(after) - cpu_s(before)) / N * 1e6:.1f} us, the echoing side {cpu_s(child) / N * 1e6:.1f} us")


if __name__ == "__main__":
    main()
