"""AsyncEngine: the LLMEngine driven by one background thread, spoken to from asyncio.

The core is not thread-safe, so every call becomes a command on a queue that only the engine
thread executes; results and stream items come back through `loop.call_soon_threadsafe`.
Closing or cancelling a stream aborts its request, so a client that goes away frees its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from microserving.tokenizer import Tokenizer

from .api import (
    AlreadyExistsError,
    EngineError,
    EngineStatus,
    GenerateOutput,
    KVChunk,
    KVLayout,
    PrepRecvResult,
    SamplingParams,
    UnavailableError,
)
from .config import EngineConfig
from .disaggregation import EngineEvent, SendFailed, SendReady
from .llm_engine import LLMEngine

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")
_IDLE_WAIT_S = 1.0  # longest idle sleep; commands wake the thread at once anyway
_STOP = object()


class _Command:
    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[LLMEngine], Any], future: asyncio.Future[Any] | None):
        self.fn = fn
        self.future = future


class _SinkStream:
    """A request's stream that hands each output to a callback in the event loop (the
    multiplexed Engine.Generate path: no queue and no task switch per output) and settles
    `done` when the request finishes or fails."""

    __slots__ = ("on_output", "done")

    def __init__(self, on_output: Callable[[GenerateOutput], None], done: asyncio.Future[None]):
        self.on_output = on_output
        self.done = done

    def put_nowait(self, item: object) -> None:
        if self.done.done():
            return
        if isinstance(item, BaseException):
            self.done.set_exception(item)
            return
        assert isinstance(item, GenerateOutput)  # only outputs and errors reach a stream
        try:
            self.on_output(item)
        except BaseException as exc:  # noqa: BLE001 - surfaces in run_generate
            self.done.set_exception(exc)
            return
        if item.is_finished:
            self.done.set_result(None)


class AsyncEngine:
    def __init__(
        self, config: EngineConfig, core_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine
    ) -> None:
        """`core_factory` builds the core in the engine thread; only the benchmark-only
        synthetic backend passes another (engine_shim/synthetic), to drive this same path."""
        self.config = config
        self._core_factory = core_factory
        self._core: LLMEngine | None = None
        self._commands: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Per request: an asyncio.Queue (generate) or a _SinkStream (run_generate).
        self._generate_queues: dict[str, Any] = {}
        self._send_queues: dict[str, Any] = {}
        self._status: EngineStatus | None = None
        self._is_stopping = False

    # ---- lifecycle ----
    async def start(self) -> None:
        """Load the model in the engine thread and warm it up."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        started: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(started,), name="engine-loop", daemon=True
        )
        self._thread.start()
        await started

    async def shutdown(self) -> None:
        if self._thread is None or self._is_stopping:
            return
        self._is_stopping = True
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        error = UnavailableError("engine shut down")
        for q in [*self._generate_queues.values(), *self._send_queues.values()]:
            q.put_nowait(error)

    # ---- facts (valid after start) ----
    @property
    def thread_native_id(self) -> int | None:
        """The engine thread's id in the OS (/proc/PID/task/ID), once started."""
        return None if self._thread is None else self._thread.native_id

    @property
    def core(self) -> LLMEngine:
        if self._core is None:
            raise UnavailableError("engine not started")
        return self._core

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    @property
    def kv_layout(self) -> KVLayout:
        return self.core.kv_layout

    @property
    def model_id(self) -> str:
        return self.core.model_id

    @property
    def max_context_length(self) -> int:
        return self.core.max_context_length

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    def status(self) -> EngineStatus:
        """The snapshot the engine thread published after its latest command or step."""
        if self._status is None:
            raise UnavailableError("engine not started")
        return self._status

    # ---- MicroServing ops ----
    async def prep_recv(
        self,
        request_id: str,
        token_ids: Sequence[int],
        end: int,
        sampling: SamplingParams | None = None,
    ) -> PrepRecvResult:
        ids = list(token_ids)
        return await self._call(lambda core: core.prep_recv(request_id, ids, end, sampling))

    async def import_kv(self, request_id: str, chunk: KVChunk) -> None:
        await self._call(lambda core: core.import_kv(request_id, chunk))

    async def abort(self, request_id: str) -> bool:
        return await self._call(lambda core: core.abort(request_id))

    @property
    def kv_pool(self) -> torch.Tensor | None:
        """The KV pool (kv_cache.py's layout), for a transfer engine to register; peers write
        only slots a reservation handed out (begin_kv_write), and read only held sends'.
        None for a core without one (the benchmark-only synthetic core)."""
        if self._core is None:
            raise UnavailableError("engine is not running")
        kv_cache = getattr(self._core, "kv_cache", None)
        return None if kv_cache is None else kv_cache.kv

    async def begin_kv_write(self, request_id: str, write_ends_at: float) -> None:
        await self._call(lambda core: core.begin_kv_write(request_id, write_ends_at))

    async def finish_kv_write(self, request_id: str) -> None:
        await self._call(lambda core: core.finish_kv_write(request_id))

    @contextlib.asynccontextmanager
    async def held_send(
        self, request_id: str, token_ids: Sequence[int], begin: int, end: int, cache_salt: str = ""
    ) -> AsyncIterator[list[int]]:
        """Compute KV of prompt[:end] and hold the job's pages: yields the pool slots of
        [begin, end), which a transfer engine reads in place; on exit the job is released
        (its pages to the prefix cache after a clean exit, freed otherwise)."""
        ids = list(token_ids)
        stream = self._open_stream(self._send_queues, request_id)
        is_released = True
        try:
            await self._start(
                lambda core: core.remote_send(request_id, ids, begin, end, cache_salt), request_id
            )
            is_released = False
            item = await stream.get()
            if isinstance(item, BaseException):
                is_released = True
                raise item
            yield await self._call(lambda core: core.send_slots(request_id))
            is_released = True
            await self._call(lambda core: core.finish_remote_send(request_id))
        finally:
            self._close_stream(self._send_queues, request_id, stream)
            if not is_released:
                self._submit_nowait(lambda core: core.abort(request_id))

    async def hold_reservation(self, request_id: str, is_held: bool) -> None:
        await self._call(lambda core: core.hold_reservation(request_id, is_held))

    async def generate(
        self, request_id: str, token_ids: Sequence[int], begin: int, sampling: SamplingParams
    ) -> AsyncIterator[GenerateOutput]:
        """start_generate: stream outputs until the request finishes."""
        ids = list(token_ids)
        stream = self._open_stream(self._generate_queues, request_id)
        is_done = True  # until the engine accepted the request there is nothing to abort
        try:
            await self._start(lambda core: core.start_generate(request_id, ids, begin, sampling), request_id)
            is_done = False
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    is_done = True
                    raise item
                if item.is_finished:
                    is_done = True
                yield item
                if is_done:
                    return
        finally:
            self._close_stream(self._generate_queues, request_id, stream)
            if not is_done:
                self._submit_nowait(lambda core: core.abort(request_id))

    async def run_generate(
        self, request_id: str, token_ids: Sequence[int], begin: int, sampling: SamplingParams,
        on_output: Callable[[GenerateOutput], None],
    ) -> None:
        """start_generate with its outputs handed to `on_output` in the event loop as each
        step delivers them (in order); returns when the request finishes, raises when it
        fails. Cancelling it aborts the request."""
        if self._loop is None:
            raise UnavailableError("engine is not running")
        ids = list(token_ids)
        if request_id in self._generate_queues:
            raise AlreadyExistsError(f"request {request_id!r} is already streaming")
        done: asyncio.Future[None] = self._loop.create_future()
        stream = _SinkStream(on_output, done)
        self._generate_queues[request_id] = stream
        is_done = True  # until the engine accepted the request there is nothing to abort
        try:
            await self._start(lambda core: core.start_generate(request_id, ids, begin, sampling), request_id)
            is_done = False
            try:
                await done
            finally:
                # A cancelled wait cancels `done` too: that request is still running.
                is_done = done.done() and not done.cancelled()
        finally:
            self._close_stream(self._generate_queues, request_id, stream)
            if not is_done:
                self._submit_nowait(lambda core: core.abort(request_id))

    async def remote_send(
        self,
        request_id: str,
        token_ids: Sequence[int],
        begin: int,
        end: int,
        export_into: Callable[[int, int], torch.Tensor] | None = None,
        cache_salt: str = "",
    ) -> AsyncIterator[KVChunk]:
        """Compute KV of prompt[:end] and yield [begin, end) in chunks; the job's pages are
        released after the last chunk or when the iterator is closed early.

        `export_into(begin, num_tokens)`, when given, names the tensor each chunk is
        exported into (a shared-memory stage) instead of a new CPU tensor."""
        ids = list(token_ids)
        stream = self._open_stream(self._send_queues, request_id)
        is_released = True
        try:
            await self._start(lambda core: core.remote_send(request_id, ids, begin, end, cache_salt), request_id)
            is_released = False
            item = await stream.get()
            if isinstance(item, BaseException):
                is_released = True
                raise item
            windows = await self._call(lambda core: core.export_windows(request_id))

            def export(i: int) -> asyncio.Future[KVChunk]:
                chunk_begin, num_tokens = windows[i]
                is_last = i == len(windows) - 1
                out = None if export_into is None else export_into(chunk_begin, num_tokens)
                return asyncio.ensure_future(self._call(
                    lambda core: _export(core, request_id, chunk_begin, num_tokens, is_last, out)
                ))

            # One chunk of lookahead: the engine thread copies chunk i+1 out of the pool
            # while the consumer sends chunk i, so copy and transfer overlap.
            pending = export(0) if windows else None
            for i in range(len(windows)):
                assert pending is not None  # set for every index below len(windows)
                chunk = await pending
                is_released = i == len(windows) - 1
                pending = export(i + 1) if not is_released else None
                try:
                    yield chunk
                except BaseException:
                    if pending is not None:
                        pending.cancel()
                    raise
        finally:
            self._close_stream(self._send_queues, request_id, stream)
            if not is_released:
                self._submit_nowait(lambda core: core.abort(request_id))

    # ---- plumbing: event loop side ----
    def _open_stream(self, streams: dict[str, Any], request_id: str) -> asyncio.Queue[Any]:
        if request_id in streams:
            raise AlreadyExistsError(f"request {request_id!r} is already streaming")
        stream: asyncio.Queue[Any] = asyncio.Queue()
        streams[request_id] = stream
        return stream

    @staticmethod
    def _close_stream(streams: dict[str, Any], request_id: str, stream: object) -> None:
        if streams.get(request_id) is stream:
            del streams[request_id]

    async def _call(self, fn: Callable[[LLMEngine], T]) -> T:
        if self._loop is None or self._is_stopping:
            raise UnavailableError("engine is not running")
        future: asyncio.Future[T] = self._loop.create_future()
        self._commands.put(_Command(fn, future))
        return await future

    async def _start(self, fn: Callable[[LLMEngine], None], request_id: str) -> None:
        try:
            await self._call(fn)
        except asyncio.CancelledError:
            # The command may still run after we stop waiting: queue an abort behind it.
            self._submit_nowait(lambda core: core.abort(request_id))
            raise

    def _submit_nowait(self, fn: Callable[[LLMEngine], Any]) -> None:
        if not self._is_stopping:
            self._commands.put(_Command(fn, None))

    # ---- plumbing: engine thread side ----
    def _thread_main(self, started: asyncio.Future[None]) -> None:
        try:
            core = self._core_factory(self.config)
            core.warmup()
        except Exception as exc:  # the model failed to load: report it to start()
            logger.exception("engine failed to start")
            self._resolve(started, exc=exc)
            return
        self._core = core
        self._status = core.status()
        self._resolve(started, value=None)
        while self._run_commands(core, block=not core.has_work):
            if core.has_work:
                self._step(core)

    def _run_commands(self, core: LLMEngine, block: bool) -> bool:
        """Run queued commands (waiting for one if idle); False once asked to stop."""
        timeout = self._idle_timeout(core) if block else None
        while True:
            try:
                item = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
            except queue.Empty:
                if block:
                    core.reap_expired_reservations()  # and fences past their end
                    self._status = core.status()  # what they freed shows in GetStatus
                return True
            if item is _STOP:
                return False
            self._execute(core, item)
            self._status = core.status()
            block = False  # after the first command, drain without waiting

    @staticmethod
    def _idle_timeout(core: LLMEngine) -> float:
        deadline = core.next_deadline()
        if deadline is None:
            return _IDLE_WAIT_S
        return min(_IDLE_WAIT_S, max(0.0, deadline - time.monotonic()) + 0.01)

    def _execute(self, core: LLMEngine, command: _Command) -> None:
        try:
            value = command.fn(core)
        except EngineError as exc:
            self._resolve(command.future, exc=exc)
        except Exception as exc:
            logger.exception("engine command failed")
            self._resolve(command.future, exc=EngineError(f"internal engine error: {exc}"))
        else:
            self._status = core.status()  # publish before the caller resumes
            self._resolve(command.future, value=value)

    def _step(self, core: LLMEngine) -> None:
        try:
            events = core.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_everything(core, EngineError(f"internal engine error: {exc}"))
            return
        self._status = core.status()  # publish before consumers see the outputs
        if events and self._loop is not None:
            # One hand-off per step, whatever the batch size: a wake-up of the event loop
            # (a write to its self-pipe) per output was the shim's largest per-token cost.
            self._loop.call_soon_threadsafe(self._dispatch_all, events)

    def _dispatch_all(self, events: list[EngineEvent]) -> None:
        """In the event loop: each event of one step to its stream, in order."""
        generate, send = self._generate_queues, self._send_queues
        for event in events:
            if isinstance(event, GenerateOutput):
                stream = generate.get(event.request_id)
                item: object = event
            elif isinstance(event, SendReady):
                stream, item = send.get(event.request_id), event
            elif isinstance(event, SendFailed):
                stream, item = send.get(event.request_id), event.error
            else:
                continue
            if stream is not None:  # its consumer may have gone: drop the item
                stream.put_nowait(item)

    def _fail_everything(self, core: LLMEngine, error: EngineError) -> None:
        for request_id in [*self._generate_queues, *self._send_queues]:
            try:
                core.abort(request_id)
            except Exception:
                logger.exception("abort after engine failure failed for %s", request_id)
            self._post(self._generate_queues, request_id, error)
            self._post(self._send_queues, request_id, error)

    def _post(self, streams: dict[str, Any], request_id: str, item: object) -> None:
        loop = self._loop
        if loop is None:
            return

        def put() -> None:
            stream = streams.get(request_id)
            if stream is not None:  # its consumer may have gone: drop the item
                stream.put_nowait(item)

        loop.call_soon_threadsafe(put)

    def _resolve(
        self, future: asyncio.Future[Any] | None, value: object = None, exc: BaseException | None = None
    ) -> None:
        loop = self._loop
        if future is None or loop is None:
            return

        def settle() -> None:
            if future.done():
                return  # the awaiting coroutine was cancelled
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(value)

        loop.call_soon_threadsafe(settle)


def _export(
    core: LLMEngine,
    request_id: str,
    begin: int,
    num_tokens: int,
    is_last: bool,
    out: torch.Tensor | None,
) -> KVChunk:
    chunk = core.export_kv(request_id, begin, num_tokens, out)
    if is_last:
        core.finish_remote_send(request_id)
    return chunk
