"""`microserving gateway --workers N`: each worker listens on a socket of its own in the port's
SO_REUSEPORT group (gateway/workers.py), so a burst of connections spreads over every worker;
a worker that dies is replaced; SIGTERM stops them all. Real gateway processes; which worker
holds a connection is read from /proc (the socket inodes in each worker's fds)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.stack_procs import Service, launch, until, wait_listening, worker_pids

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(sys.platform != "linux", reason="SO_REUSEPORT balances on Linux")]

WORKERS = 4
CONNECTIONS = 48
# Nothing listens here: /metrics needs no router.
NO_ROUTER = "127.0.0.1:9"


def _accepted_inodes(port: int) -> set[str]:
    """Inodes of the established connections whose local end is `port` (the server side)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                inodes.add(fields[9])
    return inodes


def _held_by(pid: int, inodes: set[str]) -> int:
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target[8:-1] in inodes:
            held += 1
    return held


def _get_metrics(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: gateway\r\n\r\n")
    return sock.recv(64)


@contextlib.contextmanager
def _gateway(tmp_path: Path, workers: int, *extra: str) -> Iterator[Service]:
    service = launch("gateway", ["gateway", "--router", NO_ROUTER, "--port", "0",
                                 "--workers", str(workers), *extra], tmp_path)
    try:
        wait_listening([service])
        yield service
    finally:
        service.kill(whole_group=True)


@pytest.fixture()
def gateway(tmp_path: Path) -> Iterator[Service]:
    with _gateway(tmp_path, WORKERS) as service:
        yield service


@contextlib.contextmanager
def _connections(port: int, count: int) -> Iterator[list[socket.socket]]:
    """`count` connections to the gateway, each asked for /metrics and answered 200."""
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    try:
        answers = [_get_metrics(s) for s in sockets]
        assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers  # what came back
        yield sockets
    finally:
        for s in sockets:
            s.close()


def test_a_burst_of_connections_spreads_over_every_worker(gateway: Service) -> None:
    assert until(lambda: len(worker_pids(gateway.process.pid)) == WORKERS)
    workers = worker_pids(gateway.process.pid)
    # Every connection served (accepted and answered) before counting who holds it.
    with _connections(gateway.port, CONNECTIONS):
        inodes = _accepted_inodes(gateway.port)
        held = {pid: _held_by(pid, inodes) for pid in workers}
        assert sum(held.values()) == CONNECTIONS, held
        # By address hash: about 12 each. One shared socket gave a burst to whichever worker
        # woke first (32 / 32 / 0 / 0 in the capacity benchmark).
        assert min(held.values()) >= 1 and max(held.values()) <= CONNECTIONS // 2, held


def test_a_dead_worker_is_replaced_and_sigterm_stops_them_all(gateway: Service) -> None:
    workers = worker_pids(gateway.process.pid)
    os.kill(workers[0], signal.SIGKILL)
    assert until(lambda: len(set(worker_pids(gateway.process.pid)) - set(workers)) == 1
                  and len(worker_pids(gateway.process.pid)) == WORKERS)
    # The new worker listens too: every connection of a burst is answered.
    with _connections(gateway.port, 16):
        pass
    assert "worker 0 exited" in gateway.log()
    children = worker_pids(gateway.process.pid)
    gateway.process.send_signal(signal.SIGTERM)
    assert gateway.process.wait(timeout=30) == 0
    assert until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 15)


def test_a_hung_worker_is_replaced(tmp_path: Path) -> None:
    """A worker whose serving loop stops answering (SIGSTOP: alive, never exits) is killed and
    replaced after --worker-hang-timeout-s; the others are left alone."""
    with _gateway(tmp_path, 2, "--worker-hang-timeout-s", "3") as service:
        # Started: each worker's loop has answered a ping before any can count as hung.
        assert until(lambda: len(worker_pids(service.process.pid)) == 2)
        time.sleep(2)
        hung, other = worker_pids(service.process.pid)
        os.kill(hung, signal.SIGSTOP)
        assert until(lambda: hung not in worker_pids(service.process.pid)
                      and len(worker_pids(service.process.pid)) == 2, timeout_s=60)
        assert other in worker_pids(service.process.pid)
        assert re.search(r"worker \d did not answer for 3 s; replacing it", service.log())
        with _connections(service.port, 8):
            pass
