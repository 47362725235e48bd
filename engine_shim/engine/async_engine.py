"""AsyncEngine: the LLMEngine driven by one loop (core_loop.py) in a background thread or a
process of its own (core_process.py), spoken to from asyncio.

The core is not thread-safe, so every call becomes data (an op and its arguments) on the loop's
inbox, executed only there; results and step outputs come back in batches, in order. Closing
or cancelling a stream aborts its request, so a client that goes away frees its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from microserving.tokenizer import Tokenizer

from .api import (
    AlreadyExistsError,
    Continuation,
    EngineStatus,
    FailedPreconditionError,
    GenerateOutput,
    KVChunk,
    KVLayout,
    OnFirst,
    PackedOutput,
    PrepRecvResult,
    SamplingParams,
    StatusFields,
    UnavailableError,
    status_from_fields,
    unpack_output,
)
from .block_manager import Slots
from .config import EngineConfig
from .core_loop import (
    EVENTS,
    FAILED,
    RESULT,
    SIDE,
    STOP,
    Call,
    CoreFacts,
    CoreLoop,
    Emit,
    SideFactory,
    core_facts,
)
from .core_process import ProcessDriver
from .disaggregation import EngineEvent, FirstTokens, SendFailed, SendReady, StartFailed
from .llm_engine import LLMEngine
from .validation import TokenIds, own_ids

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)



class _ThreadDriver:
    """Runs the core in a thread of this process (the default on the CPU, and mlc-compat's)."""

    def __init__(
        self, config: EngineConfig, core_factory: Callable[[EngineConfig], LLMEngine] | None
    ) -> None:
        self._config = config
        self._core_factory = core_factory or LLMEngine
        self._calls: queue.Queue[Call | str] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.core: LLMEngine | None = None

    async def start(self, deliver: Emit, on_lost: Callable[[str], None]) -> CoreFacts:
        loop = asyncio.get_running_loop()
        started: asyncio.Future[CoreFacts] = loop.create_future()

        handoff = _Handoff(loop, deliver)

        def main() -> None:
            try:
                core = self._core_factory(self._config)
                core.warmup()
                facts = core_facts(core)
            except Exception as exc:  # the model failed to load: report it to start()
                logger.exception("engine failed to start")
                loop.call_soon_threadsafe(_settle, started, None, exc)
                return
            self.core = core
            loop.call_soon_threadsafe(_settle, started, facts, None)
            CoreLoop(core, self, handoff.emit).run()

        self._thread = threading.Thread(target=main, name="engine-loop", daemon=True)
        self._thread.start()
        return await started

    def get(self, timeout: float | None) -> Call | str:
        return self._calls.get_nowait() if timeout is None else self._calls.get(timeout=timeout)

    def submit(self, call: Call) -> None:
        self._calls.put(call)

    async def stop(self) -> None:
        if self._thread is not None:
            self._calls.put(STOP)
            await asyncio.to_thread(self._thread.join)


class _Handoff:
    """The engine thread's batches into the event loop, in order, waking the loop only when
    it has none pending: call_soon_threadsafe writes to the loop's self-pipe at every call
    (8.5% of a decode shim's samples on the CPU bench, disagg at 64 streams, where calls and
    steps flush several batches a step), and a loop behind the engine takes all it has
    missed in one wake-up."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Emit) -> None:
        self._loop = loop
        self._deliver = deliver
        self._lock = threading.Lock()
        self._pending: list[tuple[list[tuple[Any, ...]], StatusFields]] = []

    def emit(self, batch: list[tuple[Any, ...]], status: StatusFields) -> None:
        """In the engine thread."""
        with self._lock:
            self._pending.append((batch, status))
            if len(self._pending) > 1:
                return  # the loop is already called for what is pending
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        """In the event loop."""
        with self._lock:
            pending, self._pending = self._pending, []
        for batch, status in pending:
            try:
                self._deliver(batch, status)
            except Exception:  # as asyncio would for a callback of its own: the rest go on
                logger.exception("delivering an engine batch failed")


def _settle(future: asyncio.Future[Any], value: object, exc: BaseException | None) -> None:
    if future.done():
        return  # the awaiting coroutine was cancelled
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


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


@dataclass(eq=False)
class FirstSink:
    """Where a send's first tokens go (AsyncEngine.sampling_first): the next send of its id
    takes `sampling` to the core (`is_taken`); `done` ends True once they were handed to
    `on_first`, False when the core dropped them (the send ended before its prompt's last
    position was computed)."""

    sampling: SamplingParams
    on_first: OnFirst
    done: asyncio.Future[bool]
    is_taken: bool = False

    async def delivered(self) -> None:
        """After the send's result: its first tokens went out before it, or this raises."""
        if not self.is_taken:
            raise FailedPreconditionError("sample_first_token: the send computed nothing here, so sampled nothing")
        if not await self.done:
            raise FailedPreconditionError("sample_first_token: the send ended before its first tokens were sampled")


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        core_factory: Callable[[EngineConfig], LLMEngine] | None = None,
        *,
        own_process: bool = False,
        side_factory: SideFactory | None = None,
    ) -> None:
        """`core_factory` builds the core where it runs; only the benchmark-only synthetic
        backend passes one (engine_shim/backends/synthetic), to drive this same path.
        `own_process`: the core runs in a process of its own (core_process.py) instead of a
        thread. `side_factory` (a process core only): work the core's process runs beside it
        (core_loop.Side), reached with call_side/submit_side, its reports to `on_side_events`."""
        if side_factory is not None and not own_process:
            raise ValueError("a side runs only beside a core in its own process")
        self.config = config
        self._driver: _ThreadDriver | ProcessDriver = (
            ProcessDriver(config, core_factory, side_factory) if own_process
            else _ThreadDriver(config, core_factory)
        )
        self.on_side_events: Callable[[list[Any]], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._facts: CoreFacts | None = None
        self._tokenizer: Tokenizer | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        # Per request: an asyncio.Queue (generate) or a _SinkStream (run_generate).
        self._generate_queues: dict[str, Any] = {}
        self._send_queues: dict[str, Any] = {}
        self._firsts: dict[str, FirstSink] = {}  # sends that sample their request's first tokens
        self._status: EngineStatus | None = None  # built from _status_fields when asked
        self._status_fields: StatusFields | None = None
        self._is_stopping = False
        self._is_own_process = own_process
        self._lost_reason: asyncio.Future[str] | None = None

    # ---- lifecycle ----
    async def start(self) -> None:
        """Load the model where the core runs and warm it up."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._lost_reason = self._loop.create_future()
        facts = await self._driver.start(self._deliver, self._lost)
        self._facts = facts

    async def shutdown(self) -> None:
        if self._loop is None or self._is_stopping:
            return
        self._is_stopping = True
        await self._driver.stop()
        self._fail_all(UnavailableError("engine shut down"))

    # ---- facts (valid after start) ----
    @property
    def engine_tid(self) -> int | None:
        """The engine loop's thread id in the OS (/proc/TID/task/TID), once started; in a
        core process, that process's main thread."""
        return None if self._facts is None else self._facts.engine_tid

    @property
    def engine_pid(self) -> int | None:
        """The core process's id, when the core runs in one."""
        return self._driver.pid if isinstance(self._driver, ProcessDriver) else None

    @property
    def facts(self) -> CoreFacts:
        if self._facts is None:
            raise UnavailableError("engine not started")
        return self._facts

    @property
    def tokenizer(self) -> Tokenizer:
        if isinstance(self._driver, _ThreadDriver) and self._driver.core is not None:
            return self._driver.core.tokenizer
        if self._tokenizer is None:  # the core's lives in its process: the same, built here
            self._tokenizer = Tokenizer.from_model(self.config.model)
        return self._tokenizer

    @property
    def kv_layout(self) -> KVLayout:
        return self.facts.kv_layout

    @property
    def model_id(self) -> str:
        return self.facts.model_id

    @property
    def max_context_length(self) -> int:
        return self.facts.max_context_length

    @property
    def vocab_size(self) -> int:
        return self.facts.vocab_size

    def status(self) -> EngineStatus:
        """The snapshot the core sent with its latest results or step."""
        if self._status is None:
            if self._facts is None:
                raise UnavailableError("engine not started")
            started, fields = self._facts.status, self._status_fields
            # no batch yet: the status the core started with
            self._status = started if fields is None else status_from_fields(started, fields)
        return self._status

    # ---- MicroServing ops ----
    async def prep_recv(
        self,
        request_id: str,
        token_ids: TokenIds,
        end: int,
        sampling: SamplingParams | None = None,
        held: bool = False,
        whole_prompt: bool = False,
    ) -> PrepRecvResult:
        """`held`: the reservation has no TTL in the engine; the caller ends it
        (submit_expire_reservation) or consumes it. `whole_prompt`: as LLMEngine.prep_recv's."""
        result: PrepRecvResult = await self._call(
            "prep_recv", request_id, own_ids(token_ids), end, sampling, held, whole_prompt
        )
        return result

    def submit_hold_reservation(self, request_id: str, is_held: bool) -> None:
        """hold_reservation, not waited for: it runs before any call submitted after it."""
        self._submit_nowait("hold_reservation", request_id, is_held)

    def submit_expire_reservation(self, request_id: str) -> None:
        """End a held reservation (prep_recv(held=True)) whose owner's TTL passed, not
        waited for: it runs before any call submitted after it."""
        self._submit_nowait("expire_reservation", request_id)

    async def import_kv(self, request_id: str, chunk: KVChunk) -> None:
        await self._call("import_kv", request_id, chunk)

    async def abort(self, request_id: str) -> bool:
        return bool(await self._call("abort", request_id))

    @property
    def kv_pool(self) -> torch.Tensor | None:
        """The KV pool (kv_cache.py's layout; shared with a core process), for a transfer
        engine to register; peers write only slots a reservation handed out
        (begin_kv_write), and read only held sends'. None for a core without one (the
        benchmark-only synthetic core)."""
        if self._facts is None:
            raise UnavailableError("engine is not running")
        return self._facts.kv_pool

    async def begin_kv_write(self, request_id: str, write_ends_at: float) -> None:
        await self._call("begin_kv_write", request_id, write_ends_at)

    def submit_begin_kv_write(self, request_id: str, write_ends_at: float) -> None:
        """begin_kv_write, not waited for: it runs before any call submitted after it."""
        self._submit_nowait("begin_kv_write", request_id, write_ends_at)

    async def cancel_kv_write(self, request_id: str, is_held: bool) -> None:
        await self._call("cancel_kv_write", request_id, is_held)

    async def finish_kv_write(self, request_id: str) -> None:
        await self._call("finish_kv_write", request_id)

    @contextlib.asynccontextmanager
    async def held_send(
        self, request_id: str, token_ids: TokenIds, begin: int, end: int, cache_salt: str = "",
        *, fetch_slots: bool = True, on_accepted: Callable[[], None] | None = None,
    ) -> AsyncIterator[Slots | None]:
        """Compute KV of prompt[:end] and hold the job's pages: yields the pool slots of
        [begin, end), which a transfer engine reads in place (None with `fetch_slots` off:
        the core's side reads them itself, a round trip less); on exit the job is released
        (its pages to the prefix cache after a clean exit, freed otherwise). The release is
        not awaited: the core runs it in order, before any later call. `on_accepted` is
        called once the core has taken the job (for timing: queue and compute come after)."""
        ids = own_ids(token_ids)
        stream = self._open_stream(self._send_queues, request_id)
        is_released = True
        try:
            await self._start_op(request_id, "remote_send", request_id, ids, begin, end, cache_salt,
                                 self._take_first(request_id))
            is_released = False
            if on_accepted is not None:
                on_accepted()
            item = await stream.get()
            if isinstance(item, BaseException):
                is_released = True
                raise item
            yield await self._call("send_slots", request_id) if fetch_slots else None
            is_released = True
            self._submit_nowait("finish_remote_send", request_id)
        finally:
            self._close_stream(self._send_queues, request_id, stream)
            if not is_released:
                self._submit_nowait("abort", request_id)

    async def hold_reservation(self, request_id: str, is_held: bool) -> None:
        await self._call("hold_reservation", request_id, is_held)

    @contextlib.contextmanager
    def sampling_first(self, request_id: str, sampling: SamplingParams, on_first: OnFirst) -> Iterator[FirstSink]:
        """Around a send (remote_send, held_send) of `request_id`: its job also samples the
        request's first tokens with `sampling` (LLMEngine.remote_send's `first`), handed to
        `on_first` in the event loop as the core delivers them; a send made again under the
        id in the body (a fallback that computes from the prefix cache) samples nothing."""
        if self._loop is None:
            raise UnavailableError("engine is not running")
        if request_id in self._firsts:
            raise AlreadyExistsError(f"request {request_id!r} already samples its first tokens")
        sink = FirstSink(sampling, on_first, self._loop.create_future())
        self._firsts[request_id] = sink
        try:
            yield sink
        finally:
            if self._firsts.get(request_id) is sink:
                del self._firsts[request_id]
            if not sink.done.done():
                sink.done.cancel()

    def _take_first(self, request_id: str) -> SamplingParams | None:
        """The core's remote_send's `first`: the sampling of a sampling_first around it, for
        the first send of the id only."""
        sink = self._firsts.get(request_id)
        if sink is None or sink.is_taken:
            return None
        sink.is_taken = True
        return sink.sampling

    async def generate(
        self, request_id: str, token_ids: TokenIds, begin: int, sampling: SamplingParams,
        after_kv: bool = False, continuations: Sequence[Continuation] = (),
    ) -> AsyncIterator[GenerateOutput]:
        """start_generate: stream outputs until the request finishes. `after_kv`: the
        engine starts it once its reservation's KV is complete; `continuations`: its output
        began on the engine that sent the KV (LLMEngine.start_generate)."""
        ids = own_ids(token_ids)
        stream = self._open_stream(self._generate_queues, request_id)
        is_done = True  # until the engine accepted the request there is nothing to abort
        try:
            await self._start_op(request_id, "start_generate", request_id, ids, begin, sampling, after_kv,
                                 tuple(continuations))
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
                self._submit_nowait("abort", request_id)

    async def run_generate(
        self, request_id: str, token_ids: TokenIds, begin: int, sampling: SamplingParams,
        on_output: Callable[[GenerateOutput], None], after_kv: bool = False,
        continuations: Sequence[Continuation] = (),
    ) -> None:
        """start_generate with its outputs handed to `on_output` in the event loop as each
        step delivers them (in order); returns when the request finishes, raises when it
        fails. Cancelling it aborts the request."""
        if self._loop is None:
            raise UnavailableError("engine is not running")
        ids = own_ids(token_ids)
        if request_id in self._generate_queues:
            raise AlreadyExistsError(f"request {request_id!r} is already streaming")
        done: asyncio.Future[None] = self._loop.create_future()
        stream = _SinkStream(on_output, done)
        self._generate_queues[request_id] = stream
        is_done = True  # until the engine accepted the request there is nothing to abort
        try:
            await self._start_op(request_id, "start_generate", request_id, ids, begin, sampling, after_kv,
                                 tuple(continuations))
            is_done = False
            try:
                await done
            finally:
                # A cancelled wait cancels `done` too: that request is still running.
                is_done = done.done() and not done.cancelled()
        finally:
            self._close_stream(self._generate_queues, request_id, stream)
            if not is_done:
                self._submit_nowait("abort", request_id)

    async def remote_send(
        self,
        request_id: str,
        token_ids: TokenIds,
        begin: int,
        end: int,
        export_into: Callable[[int, int], torch.Tensor] | None = None,
        cache_salt: str = "",
        *,
        window: Awaitable[tuple[int, Callable[[int, int], torch.Tensor] | None]] | None = None,
    ) -> AsyncIterator[KVChunk]:
        """Compute KV of prompt[:end] and yield [begin, end) in chunks; the job's pages are
        released after the last chunk or when the iterator is closed early.

        `export_into(begin, num_tokens)`, when given, names the tensor each chunk is
        exported into (a shared-memory stage) instead of a new CPU tensor. `window`, when
        given, is awaited once the KV is computed for where the export starts (at or after
        `begin`) and `export_into`: a send whose receiver was not known when it began."""
        ids = own_ids(token_ids)
        stream = self._open_stream(self._send_queues, request_id)
        is_released = True
        try:
            await self._start_op(request_id, "remote_send", request_id, ids, begin, end, cache_salt,
                                 self._take_first(request_id))
            is_released = False
            item = await stream.get()
            if isinstance(item, BaseException):
                is_released = True
                raise item
            export_begin = begin
            if window is not None:
                export_begin, export_into = await window
            windows = _from_position(await self._call("export_windows", request_id), export_begin)

            def export(i: int) -> asyncio.Future[KVChunk]:
                chunk_begin, num_tokens = windows[i]
                is_last = i == len(windows) - 1
                return asyncio.ensure_future(
                    self._export(request_id, chunk_begin, num_tokens, is_last, export_into)
                )

            # One chunk of lookahead: the engine copies chunk i+1 out of the pool while the
            # consumer sends chunk i, so copy and transfer overlap.
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
                self._submit_nowait("abort", request_id)

    async def _export(
        self, request_id: str, begin: int, num_tokens: int, is_last: bool,
        export_into: Callable[[int, int], torch.Tensor] | None,
    ) -> KVChunk:
        if not self._is_own_process or export_into is None:
            out = None if export_into is None else export_into(begin, num_tokens)
            chunk: KVChunk = await self._call("export_chunk", request_id, begin, num_tokens, is_last, out)
            return chunk
        # The core writes the window itself (export_into pickles: kv_plane/shm.StageWindow);
        # only the chunk's place comes back, not its bytes.
        return await self._call(
            "export_chunk", request_id, begin, num_tokens, is_last, None, export_into
        )

    # ---- plumbing ----
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

    async def call_side(self, op: str, *args: Any) -> Any:
        """An op of the core's side (see side_factory), its result awaited."""
        return await self._call(op, *args)

    def submit_side(self, op: str, *args: Any) -> None:
        """An op of the core's side, nobody waiting for its result (it runs in order)."""
        self._submit_nowait(op, *args)

    async def _call(self, op: str, *args: Any) -> Any:
        if self._loop is None or self._is_stopping:
            raise UnavailableError("engine is not running")
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[call_id] = future
        try:
            self._driver.submit(Call(call_id, op, args))
            return await future
        finally:
            self._pending.pop(call_id, None)

    async def _start_op(self, request_id: str, op: str, *args: Any) -> None:
        try:
            await self._call(op, *args)
        except asyncio.CancelledError:
            # The call may still run after we stop waiting: queue an abort behind it.
            self._submit_nowait("abort", request_id)
            raise

    def _submit_nowait(self, op: str, *args: Any) -> None:
        if not self._is_stopping:
            with contextlib.suppress(UnavailableError):
                self._driver.submit(Call(None, op, args))

    def _deliver(self, batch: list[tuple[Any, ...]], status: StatusFields) -> None:
        """In the event loop: one batch of the core's, in order (results, step events)."""
        # published before consumers see what changed it
        self._status, self._status_fields = None, status
        for entry in batch:
            kind = entry[0]
            if kind == EVENTS:
                self._dispatch_all(entry[1])
            elif kind == RESULT:
                _, call_id, value, error = entry
                future = self._pending.pop(call_id, None)
                if future is not None:
                    _settle(future, value, error)
            elif kind == FAILED:
                self._fail_requests(entry[1])
            elif kind == SIDE and self.on_side_events is not None:
                self.on_side_events(entry[1])

    def _dispatch_all(self, events: list[EngineEvent | PackedOutput]) -> None:
        """Each event of one step to its stream, in order (a core in its own process sends
        its outputs packed: unpacked here, in the shim's process)."""
        generate, send = self._generate_queues, self._send_queues
        for event in events:
            if type(event) is tuple:
                event = unpack_output(event)
            if isinstance(event, GenerateOutput):
                stream = generate.get(event.request_id)
                item: object = event
            elif isinstance(event, SendReady):
                stream, item = send.get(event.request_id), event
            elif isinstance(event, SendFailed):
                stream, item = send.get(event.request_id), event.error
            elif isinstance(event, StartFailed):
                stream, item = generate.get(event.request_id), event.error
            elif isinstance(event, FirstTokens):
                self._deliver_first(event)
                continue
            else:
                continue
            if stream is not None:  # its consumer may have gone: drop the item
                stream.put_nowait(item)

    def _deliver_first(self, event: FirstTokens) -> None:
        sink = self._firsts.get(event.request_id)
        if sink is None or sink.done.done():  # its send has ended: nobody waits for them
            return
        if event.output is None:
            sink.done.set_result(False)
            return
        output = event.output if isinstance(event.output, GenerateOutput) else unpack_output(event.output)
        sink.on_first(output, event.sampler_states)
        sink.done.set_result(True)

    def _fail_requests(self, error: BaseException) -> None:
        """A step failed: abort every request this side knows and fail its stream."""
        for request_id in {*self._generate_queues, *self._send_queues}:
            self._submit_nowait("abort", request_id)
        self._fail_streams(error)

    def _fail_streams(self, error: BaseException) -> None:
        for stream in [*self._generate_queues.values(), *self._send_queues.values()]:
            stream.put_nowait(error)
        for sink in self._firsts.values():
            if sink.is_taken and not sink.done.done():
                sink.done.set_exception(error)
                sink.done.exception()  # retrieved: the send fails with the error anyway

    def _fail_all(self, error: BaseException) -> None:
        self._fail_streams(error)
        for future in self._pending.values():
            _settle(future, None, error)
        self._pending.clear()

    async def wait_lost(self) -> str:
        """Returns (why) once the core process has died; never while the engine lives."""
        if self._lost_reason is None:
            raise UnavailableError("engine not started")
        return await asyncio.shield(self._lost_reason)

    def _lost(self, reason: str) -> None:
        """The core process died: nothing in flight will ever be answered."""
        self._is_stopping = True
        self._fail_all(UnavailableError(reason))
        if self._lost_reason is not None and not self._lost_reason.done():
            self._lost_reason.set_result(reason)


def _from_position(windows: list[tuple[int, int]], begin: int) -> list[tuple[int, int]]:
    """The (begin, num_tokens) export windows cut to the positions from `begin` on."""
    return [(max(start, begin), start + n - max(start, begin)) for start, n in windows if start + n > begin]
