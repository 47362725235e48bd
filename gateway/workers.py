"""The gateway's worker processes, each listening on an SO_REUSEPORT socket of its own.

uvicorn's supervisor (`uvicorn.supervisors.Multiprocess`) hands every worker the one listening
socket the parent bound. The workers then race for each connection on a single accept queue,
and the kernel wakes them unevenly: a burst of connections goes to whichever worker is
running, which accepts all that are queued. Measured on the 2-core development VM, the
capacity benchmark's 64 client connections to 4 workers landed 32 / 32 / 0 / 0, so half the
workers never served a request, and each busy one did twice its share of every wave of
requests (their parsing, validation and relay). uvicorn has no option for a socket per worker
(encode/uvicorn PR 2472 proposes one, unmerged), so this module supervises the workers itself:
each binds its own socket to the same address with SO_REUSEPORT, and the kernel spreads new
connections over the listening sockets by their address hash. A worker that exits is started
again; its socket closes with it, so no connection waits on a queue nobody accepts from.
Linux only (elsewhere SO_REUSEPORT does not balance); the setting `reuse_port` false keeps
uvicorn's supervisor and the shared socket.

A worker that hangs without exiting would keep its share of new connections, so the parent
pings each worker's serving loop itself (the answer comes from the loop, not from a thread
beside it as in uvicorn's supervisor, so a loop blocked by Python code counts as hung too) and
replaces one that has not answered for `hang_timeout_s`.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType

import uvicorn

_LISTEN_BACKLOG = 2048
_READY_TIMEOUT_S = 120.0
_STOP_GRACE_S = 10.0
_STARTUP_FAILURE = 3  # uvicorn's exit code when the app fails to start


def reuse_port_balances() -> bool:
    """Whether SO_REUSEPORT spreads connections over several listening sockets here."""
    return sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")


def tcp_socket(host: str, port: int, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A TCP socket bound to host:port (listening unless `listen` is false), inheritable."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio turns on TCP_NODELAY only for sockets whose proto
    # says TCP, and accepted sockets inherit it; without it Nagle holds back the first SSE
    # chunk of a reused connection for ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(_LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


class _PingedServer(uvicorn.Server):
    """uvicorn's server, its loop answering the parent's pings on `health` once started."""

    def __init__(self, config: uvicorn.Config, health: Connection) -> None:
        super().__init__(config)
        self.health = health

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        asyncio.get_running_loop().add_reader(self.health.fileno(), self._pong)

    def _pong(self) -> None:
        try:
            self.health.recv_bytes()
            self.health.send_bytes(b"1")
        except (EOFError, OSError):  # the parent is gone: nothing to answer
            asyncio.get_running_loop().remove_reader(self.health.fileno())


def _worker(config: uvicorn.Config, host: str, port: int, ready: Connection,
            health: Connection) -> None:
    """One worker process: its own socket in the port's SO_REUSEPORT group, then uvicorn."""
    config.configure_logging()
    sock = tcp_socket(host, port, reuse_port=True)
    ready.send(True)  # listening: connections queue on this socket from now on
    ready.close()
    _PingedServer(config, health).run(sockets=[sock])


@dataclass
class _Worker:
    """One worker process and the parent's end of its health pipe: when it last answered
    (None: not yet, the worker is still starting) and when the ping in flight went out."""

    process: BaseProcess
    conn: Connection
    answered_at: float | None = None
    sent_at: float | None = None

    def check(self, now: float, every_s: float, timeout_s: float) -> bool:
        """Ping when due, take an answer; False once a started worker has not answered a ping
        for `timeout_s`."""
        try:
            while self.conn.poll(0):
                self.conn.recv_bytes()
                self.answered_at, self.sent_at = now, None
            if self.sent_at is None and (self.answered_at is None or now - self.answered_at >= every_s):
                self.conn.send_bytes(b"?")
                self.sent_at = now
        except (EOFError, OSError):
            return True  # the process is ending: its exit is handled as such
        return not (self.answered_at is not None and self.sent_at is not None
                    and now - self.sent_at > timeout_s)


class ReusePortWorkers:
    """`workers` uvicorn workers of `config`, each on a socket of its own bound to host:port
    (which `hold`, bound but not listening, keeps while they come and go)."""

    def __init__(self, config: uvicorn.Config, hold: socket.socket, workers: int,
                 hang_timeout_s: float = 30.0) -> None:
        self.config = config
        self.host, self.port = hold.getsockname()[:2]
        self.hold = hold
        self.hang_timeout_s = hang_timeout_s
        self.num_workers = workers
        self.workers: dict[int, _Worker] = {}  # by index, once started
        self._stop = threading.Event()
        self._context = multiprocessing.get_context("spawn")

    def _start(self, index: int) -> None:
        parent_end, child_end = self._context.Pipe(duplex=False)
        health, worker_health = self._context.Pipe()
        process = self._context.Process(
            target=_worker, args=(self.config, self.host, self.port, child_end, worker_health),
            name=f"gateway-worker-{index}")
        process.start()
        child_end.close()
        worker_health.close()
        self.workers[index] = _Worker(process, health)
        try:
            if not parent_end.poll(_READY_TIMEOUT_S):
                raise RuntimeError(f"gateway worker {index} did not listen within {_READY_TIMEOUT_S:.0f} s")
            parent_end.recv()
        except EOFError:
            raise RuntimeError(f"gateway worker {index} exited before it listened "
                               f"(code {process.exitcode})") from None
        finally:
            parent_end.close()

    def run(self, on_listening: Callable[[], None]) -> None:
        """Start every worker and call `on_listening` once all of them listen; then, until
        SIGINT or SIGTERM (taken from before the first start, so that none is left behind),
        keep every worker running; then stop them all. RuntimeError: a worker did not come up."""
        def stop(signum: int, frame: FrameType | None) -> None:
            self._stop.set()

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for index in range(self.num_workers):
                self._start(index)
            on_listening()
            ping_every_s = min(5.0, self.hang_timeout_s / 2)
            while not self._stop.wait(0.5):
                now = time.monotonic()
                for index, worker in list(self.workers.items()):
                    process = worker.process
                    if process.is_alive():
                        if worker.check(now, ping_every_s, self.hang_timeout_s):
                            continue
                        print(f"microserving gateway: worker {index} did not answer for "
                              f"{self.hang_timeout_s:g} s; replacing it", file=sys.stderr, flush=True)
                        process.kill()
                        process.join()
                        worker.conn.close()
                        self._start(index)
                        continue
                    worker.conn.close()
                    if process.exitcode == _STARTUP_FAILURE:  # would fail again: give up
                        raise RuntimeError(f"worker {index} failed to start its app; stopping")
                    print(f"microserving gateway: worker {index} exited (code {process.exitcode}); "
                          "starting another", file=sys.stderr, flush=True)
                    self._start(index)
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop(self) -> None:
        """SIGTERM to every worker (uvicorn's graceful shutdown), SIGKILL after the grace."""
        processes = [worker.process for worker in self.workers.values()]
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(_STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
        self.hold.close()
