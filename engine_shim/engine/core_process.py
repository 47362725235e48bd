"""The engine core in a process of its own (as vLLM's EngineCore): the shim's event loop and the
engine's Python host work no longer share one GIL, so a GPU engine steps at its own pace while
the shim serves. The two processes meet through one pipe (a Unix socket pair): calls go in
(multiprocessing's messages), and out comes one frame per loop turn (core_loop's batches: a
4-byte length and the pickled batch), written by the core's loop without blocking and read
by the shim's event loop without blocking. The KV pool is shared, not
copied: torch hands the child's pool to the shim as shared memory (CPU) or a CUDA IPC
mapping, so the KV data plane (NIXL, shared-memory stage) registers and reads it in place.

multiprocessing's spawn context is used (a CUDA context cannot survive a fork), with torch's
tensor reductions registered so tensors in calls and results cross by handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import queue
import select
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

from microserving.gc_tuning import freeze_startup_heap

from .api import StatusFields, UnavailableError
from .core_loop import STOP, Call, CoreFacts, CoreLoop, Emit, Side, SideFactory, core_facts

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from .config import EngineConfig
    from .llm_engine import LLMEngine

logger = logging.getLogger(__name__)

_START_POLL_S = 0.5
_STOP_WAIT_S = 10.0
# The core's loop thread runs Python almost without pause (it launches the device's work), and
# another thread of the core (the writer, when the pipe was full; a transfer agent's) must win
# the GIL from it. At CPython's default switch interval (5 ms) a step's tokens could wait that
# long in the core; 0.5 ms bounds it.
_CORE_SWITCH_INTERVAL_S = 0.0005
_HEADER = struct.Struct("!I")  # a frame's length, before its pickled batch
_CALL_HEADER = struct.Struct("!i")  # multiprocessing's: a message's length (below 2 GiB)
_READ_BYTES = 1 << 20  # the shim reads the pipe this much at a time


class ProcessDriver:
    """Runs the core in a child process; `submit` and the batches it emits keep the order
    of a thread's queue."""

    def __init__(
        self,
        config: EngineConfig,
        core_factory: Callable[[EngineConfig], LLMEngine] | None,
        side_factory: SideFactory | None = None,
    ) -> None:
        self._config = config
        self._core_factory = core_factory  # picklable: a class or a module-level function
        self._side_factory = side_factory  # likewise; builds the loop's side in the child
        self._conn: Connection | None = None
        self._process: BaseProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Emit | None = None
        self._on_lost: Callable[[str], None] | None = None
        self._is_stopping = False
        self._frames: _FrameReader | None = None  # the child's batches, after its start
        self._calls: _CallWriter | None = None  # calls to the child, after its start

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def start(self, deliver: Emit, on_lost: Callable[[str], None]) -> CoreFacts:
        import torch.multiprocessing as mp  # registers tensor reductions in ForkingPickler

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=_child_main,
            args=(self._config, self._core_factory, child, logging.getLogger().level,
                  self._side_factory),
            name="engine-core",
            daemon=True,  # never outlives the shim
        )
        process.start()
        child.close()
        self._conn, self._process = parent, process
        try:
            facts = await asyncio.to_thread(_await_start, parent, process)
        except BaseException:
            _end(process)
            raise
        self._loop, self._deliver, self._on_lost = asyncio.get_running_loop(), deliver, on_lost
        self._frames = _FrameReader(parent)
        self._calls = _CallWriter(parent, self._loop)
        self._loop.add_reader(parent.fileno(), self._on_readable)
        return facts

    def submit(self, call: Call) -> None:
        if self._calls is None or self._is_stopping:
            raise UnavailableError("engine is not running")
        try:
            self._calls.send(call)
        except OSError as error:  # the child is gone; the reader reports it
            raise UnavailableError(f"engine process unreachable: {error}") from None

    async def stop(self) -> None:
        if self._process is None or self._is_stopping:
            return
        self._is_stopping = True
        if self._calls is not None:
            with contextlib.suppress(OSError):
                self._calls.send(STOP)  # after every call still queued
        await asyncio.to_thread(self._process.join, _STOP_WAIT_S)
        self._close()
        await asyncio.to_thread(_end, self._process)

    def _on_readable(self) -> None:
        """In the event loop: every complete frame the child has written so far, then the
        child's end if it closed the pipe."""
        frames, deliver = self._frames, self._deliver
        assert frames is not None and deliver is not None  # set before the reader is added
        batches, is_closed = frames.read()
        for batch, status in batches:
            deliver(batch, status)
        if is_closed:
            self._lost()

    def _lost(self) -> None:
        self._close()
        if self._is_stopping:
            return
        self._is_stopping = True
        code = None if self._process is None else self._process.exitcode
        reason = f"engine process exited (code {code})"
        logger.error("%s; failing every request in flight", reason)
        if self._on_lost is not None:
            self._on_lost(reason)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._frames is not None:
            self._frames.close()
        if self._calls is not None:
            self._calls.close()
            self._calls = None
        if self._loop is not None:
            self._loop.remove_reader(conn.fileno())
        conn.close()


class _CallWriter:
    """Calls to the child, in order, without blocking the event loop: each goes out as
    multiprocessing's message (a 4-byte length, then the call pickled as Connection.send
    pickles it, so the child's Connection.recv reads it), and what the pipe cannot take at
    once waits here, in order, written as the pipe drains. Connection.send itself is not
    safe here: an event loop's reader may set the pipe non-blocking (uvloop's add_reader
    does, as libuv's poll handles do), and a send into a full pipe then fails, after writing
    part of a message or none of it."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop) -> None:
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._loop = loop
        self._pending = bytearray()  # bytes of calls not yet written, in order
        self._is_watching = False  # waiting for the pipe to take more

    def send(self, call: object) -> None:
        """Queue `call` after every call before it; OSError if the child is gone."""
        data = ForkingPickler.dumps(call)
        frame = _CALL_HEADER.pack(len(data)) + data
        if not self._pending:
            try:
                sent = self._sock.send(frame, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            if sent == len(frame):
                return
            frame = frame[sent:]
        self._pending += frame
        if not self._is_watching:
            self._loop.add_writer(self._sock.fileno(), self._flush)
            self._is_watching = True

    @property
    def num_pending_bytes(self) -> int:
        return len(self._pending)

    def _flush(self) -> None:
        try:
            sent = self._sock.send(self._pending, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:  # the child is gone: the reader reports it
            sent = len(self._pending)
        del self._pending[:sent]
        if not self._pending:
            self._loop.remove_writer(self._sock.fileno())
            self._is_watching = False

    def close(self) -> None:
        if self._is_watching:
            self._loop.remove_writer(self._sock.fileno())
            self._is_watching = False
        self._sock.close()


class _FrameReader:
    """The child's frames, read from a duplicate of the pipe's socket without blocking
    (Connection.recv would wait in the event loop for the rest of a message)."""

    def __init__(self, conn: Connection) -> None:
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._buffer = bytearray()  # what has come of frames not yet complete

    def read(self) -> tuple[list[tuple[Any, Any]], bool]:
        """The batches of every frame complete by now, and whether the pipe has closed."""
        buffer, is_closed = self._buffer, False
        while True:
            try:
                data = self._sock.recv(_READ_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                is_closed = True
                break
            buffer += data
            if len(data) < _READ_BYTES:
                is_closed = not data
                break
        batches = []
        begin = 0
        with memoryview(buffer) as view:
            while len(buffer) - begin >= _HEADER.size:
                (size,) = _HEADER.unpack_from(buffer, begin)
                end = begin + _HEADER.size + size
                if end > len(buffer):
                    break
                batches.append(pickle.loads(view[begin + _HEADER.size:end]))
                begin = end
        del buffer[:begin]
        return batches, is_closed

    def close(self) -> None:
        self._sock.close()


def _await_start(conn: Connection, process: BaseProcess) -> CoreFacts:
    """In a worker thread: the child's first message, the facts (or why it failed)."""
    while not conn.poll(_START_POLL_S):
        if not process.is_alive():
            raise UnavailableError(f"engine process exited while starting (code {process.exitcode})")
    try:
        kind, value = conn.recv()
    except EOFError:
        raise UnavailableError("engine process exited while starting") from None
    if kind == "failed":
        raise value
    assert isinstance(value, CoreFacts)
    return value


def _end(process: BaseProcess) -> None:
    if process.is_alive():
        process.kill()
    process.join(_STOP_WAIT_S)


# ---- the child ----

# Waits shorter than this go through select(), whose timeout has microseconds: poll() counts
# whole milliseconds and rounds 0.5 ms up to 1 (1.13 ms measured against select's 0.60). The
# loop's short waits are its polls of the side (a NIXL write's completion on the sender, its
# notification on the receiver, _SIDE_POLL_S apart): at poll()'s 1 ms a warm 256-token NIXL
# RemoteSend between two core processes took 7.5-8.1 ms on the 2-core VM, at select()'s
# 0.5 ms 5.9-6.9 (bench/kv_bench.py, tiny, three runs each, alternating).
_FINE_WAIT_S = 0.005
_SELECT_FD_LIMIT = 1024  # select() takes no descriptor at or above FD_SETSIZE


class _PipeInbox:
    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        # One poller for the loop's life: Connection.poll builds a selector at every call,
        # which the loop makes every turn.
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)
        self._fds = (conn.fileno(),)
        self._can_select = conn.fileno() < _SELECT_FD_LIMIT

    def get(self, timeout: float | None) -> Call | str:
        if timeout is not None and 0 < timeout < _FINE_WAIT_S and self._can_select:
            if not select.select(self._fds, (), (), timeout)[0]:
                raise queue.Empty
        elif not self._poller.poll(0 if timeout is None else timeout * 1000):
            raise queue.Empty
        try:
            item: Call | str = self._conn.recv()
        except EOFError:  # the shim is gone: stop
            return STOP
        return item


class _Writer:
    """Writes the loop's batches, one frame each. The loop pickles a batch and writes it
    itself, without blocking; what the pipe cannot take at once (the shim may itself be
    blocked sending a large call) goes to a thread of its own, and so does every frame after
    it until that thread has written it all. A writer thread for every batch had cost the
    loop the GIL's hand-offs in the middle of its steps (every torch call lets the GIL go): on
    the H200, py-spy found the loop's poll of its inbox alone at 4% of the loop, waiting for
    the GIL back."""

    def __init__(self, conn: Connection) -> None:
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._lock = threading.Lock()
        self._num_queued = 0  # frames handed to the thread and not yet written
        self._is_gone = False  # the shim is gone: nothing more is written
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-core-writer", daemon=True)
        self._thread.start()

    def emit(self, batch: list[tuple[Any, ...]], status: StatusFields) -> None:
        data = ForkingPickler.dumps((batch, status))
        frame = _HEADER.pack(len(data)) + data
        with self._lock:
            if self._is_gone:
                return
            if self._num_queued == 0:
                try:
                    sent = self._sock.send(frame, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    self._is_gone = True
                    return
                if sent == len(frame):
                    return
                frame = frame[sent:]
            self._num_queued += 1
        self._queue.put(frame)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._sock.close()

    def _run(self) -> None:
        while (frame := self._queue.get()) is not None:
            try:
                self._sock.sendall(frame)
            except OSError:
                with self._lock:
                    self._is_gone = True
                return
            with self._lock:
                self._num_queued -= 1


def _child_main(
    config: EngineConfig,
    core_factory: Callable[[EngineConfig], LLMEngine] | None,
    conn: Connection,
    log_level: int,
    side_factory: SideFactory | None = None,
) -> None:
    # The shim stops its core (a STOP call, or EOF when the shim dies): a signal to the whole
    # process group (a supervisor's SIGTERM, Ctrl-C) must not end the core before the shim
    # has drained, which would fail the calls in flight as "engine process exited".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.setswitchinterval(_CORE_SWITCH_INTERVAL_S)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s")
    side: Side | None = None
    try:
        core = _build_core(config, core_factory)
        core.packs_outputs = True  # plain tuples over the pipe (api.PackedOutput)
        if side_factory is not None:
            side = side_factory(core)  # reports its own failure in its facts
        facts = dataclasses.replace(core_facts(core), side=None if side is None else side.facts())
    except Exception as exc:
        logger.exception("engine failed to start")
        conn.send(("failed", UnavailableError(f"engine failed to start: {exc}")))
        return
    freeze_startup_heap()  # the model, its graphs: a full collection would stall the loop
    conn.send(("started", facts))
    writer = _Writer(conn)
    try:
        CoreLoop(core, _PipeInbox(conn), writer.emit, side).run()
    finally:
        if side is not None:
            side.close()
        writer.close()
        conn.close()
    os._exit(0)  # skip interpreter teardown of CUDA state and worker threads


def _build_core(
    config: EngineConfig, core_factory: Callable[[EngineConfig], LLMEngine] | None
) -> LLMEngine:
    if core_factory is None:
        from .llm_engine import LLMEngine

        core_factory = LLMEngine
    core = core_factory(config)
    kv_cache = getattr(core, "kv_cache", None)
    if kv_cache is not None and not kv_cache.kv.is_cuda:
        # Into shared memory before anything keeps a raw pointer to it (the warm-up, a
        # transfer engine), so the shim maps the very pages the engine writes.
        kv_cache.kv.share_memory_()
    core.warmup()
    return core
