"""Many requests on one long-lived gRPC stream, written once for the four ends that do it.

Every hop that carries tokens multiplexes: the shim's Engine.Generate (server end), the
router's engine streams (client end), the router's Router.Generate (server end) and the
gateway's router streams (client end). Two pieces serve all four:

* `Batcher` (the sending end of a server stream): outputs of many requests accumulate in the
  message being built, one entry per key; the stream's writer takes the whole message
  whenever it is free. A request's first output is never held back (the writer is woken at
  once); only what queues while the writer is busy shares the next message, and an entry of
  the message not yet taken can be merged into (several engine steps' tokens in one delta).
  One message per writer turn, not one per token. With a `min_interval_s`, a message that
  carries nothing urgent (a request's first output is) waits until that long after the
  previous one, so each message carries several engine steps: the stream interval, a trade of
  inter-token granularity for CPU on every downstream hop.
* `MultiplexedCall` (the client end): one reader task hands each entry of each incoming
  message straight to the sink registered for its request id (no task switch and no queue per
  request), and one writer task writes what the callers queue, in order (grpc.aio allows one
  write in flight per call), so cancelling a caller never cancels the call and with it every
  request on it, and a write costs a queue entry, not a task of its own.
  When the call breaks, every request on it gets the failure, and the owner opens a new call.
  With a `batch` function, what callers queued while a write was in flight goes out as one
  message (batch(messages), up to MAX_BATCH_BYTES of them): a write per writer turn, not per
  request of a wave.

Imports grpcio only; each service brings its own messages.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Hashable, Iterable, MutableSequence
from typing import Any, Generic, Protocol, TypeVar

import grpc
from grpc import aio

logger = logging.getLogger(__name__)

# A MultiplexedCall's batch carries queued messages of at most this many bytes together
# (peers' message limits are far above it; a message larger than it goes alone).
MAX_BATCH_BYTES = 64 * 1024

BatchT = TypeVar("BatchT")
EntryT = TypeVar("EntryT")
MessageT = TypeVar("MessageT")
EntryT_contra = TypeVar("EntryT_contra", contravariant=True)


class _Closed:
    """Marks a Batcher that will hand out nothing more."""


class Batcher(Generic[BatchT, EntryT]):
    """The message being built on a server stream, taken whole by the stream's writer.

    `new_batch()` makes an empty message and `entries_of(batch)` is its repeated field of
    entries (a protobuf RepeatedCompositeContainer: `add(**fields)`, `remove(entry)`)."""

    def __init__(self, new_batch: Callable[[], BatchT],
                 entries_of: Callable[[BatchT], Any], min_interval_s: float = 0.0) -> None:
        self._new_batch = new_batch
        self.min_interval_s = min_interval_s  # may change while the stream runs
        self._last_take_s = 0.0
        self._is_urgent = False
        self._in_interval = False  # the writer waits for the interval to pass
        self._entries_of = entries_of
        self._batch = new_batch()
        self._entries = entries_of(self._batch)
        self._keyed: dict[Hashable, EntryT] = {}  # key -> its entry in the message being built
        self._waiter: asyncio.Future[None] | None = None
        self._end: _Closed | BaseException | None = None
        self.num_messages = 0  # messages taken so far
        self.num_merged = 0  # entries merged into one already queued

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def add(self, **fields: Any) -> EntryT:
        """A new entry at the end of the message being built."""
        entry: EntryT = self._entries.add(**fields)
        if not self._in_interval:  # the writer waits out the interval whatever comes
            self._wake()
        return entry

    def keyed(self, key: Hashable, urgent: bool = False, **fields: Any) -> tuple[EntryT, bool]:
        """The entry of `key` in the message being built, added when there is none yet.
        -> (entry, is_new); the caller merges into an entry that is not new. `urgent`: the
        message goes out as soon as the writer is free, whatever the interval."""
        if urgent and not self._is_urgent:
            self._is_urgent = True
            self._wake()
        entry = self._keyed.get(key)
        if entry is not None:
            self.num_merged += 1
            return entry, False
        entry = self.add(**fields)
        self._keyed[key] = entry
        return entry, True

    def seal(self, key: Hashable) -> None:
        """Nothing more merges into the entry of `key` (e.g. past a choice's last delta)."""
        self._keyed.pop(key, None)

    def discard(self, key: Hashable) -> None:
        """Drops the entry of `key` from the message being built (a cancelled request)."""
        entry = self._keyed.pop(key, None)
        if entry is not None:
            self._entries.remove(entry)

    def close(self) -> None:
        """`take` hands out what is queued, then None."""
        if self._end is None:
            self._end = _Closed()
        self._wake()

    def fail(self, error: BaseException) -> None:
        """`take` raises `error` at once (what is queued is dropped)."""
        self._end = error
        self._wake()

    async def _wait(self, timeout_s: float | None = None) -> None:
        # One future per wait (cheaper than an asyncio.Event's on the token path).
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = None if timeout_s is None else loop.call_later(timeout_s, self._wake)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def take(self) -> BatchT | None:
        """The whole message built so far (waiting for a first entry, and for the interval
        when one is set and nothing urgent is queued); None once closed."""
        while True:
            if isinstance(self._end, BaseException):
                raise self._end
            if not self._entries:
                if self._end is not None:
                    return None
                await self._wait()
                continue
            if self.min_interval_s and not self._is_urgent and self._end is None:
                loop = asyncio.get_running_loop()
                due_s = self._last_take_s + self.min_interval_s
                if loop.time() < due_s:
                    self._in_interval = True
                    try:
                        await self._wait(due_s - loop.time())
                    finally:
                        self._in_interval = False
                    continue
            break
        self._last_take_s = asyncio.get_running_loop().time() if self.min_interval_s else 0.0
        self._is_urgent = False
        batch = self._batch
        self._batch = self._new_batch()
        self._entries = self._entries_of(self._batch)
        self._keyed = {}
        self.num_messages += 1
        return batch


class Sink(Protocol[EntryT_contra]):
    """Where a MultiplexedCall hands one request's entries (in its reader task)."""

    def deliver(self, entry: EntryT_contra) -> bool:
        """One entry of the request; True when it was the request's last."""

    def fail(self, error: aio.AioRpcError) -> None:
        """The call broke under the request."""


def unavailable(details: str) -> aio.AioRpcError:
    return aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, aio.Metadata(), aio.Metadata(), details)


def copy_error(error: aio.AioRpcError) -> aio.AioRpcError:
    """A fresh exception per request (one object raised in many tasks mixes their tracebacks)."""
    return aio.AioRpcError(error.code(), error.initial_metadata(), error.trailing_metadata(),
                           error.details(), error.debug_error_string())


class MultiplexedCall(Generic[MessageT, EntryT]):
    """The client end of one long-lived stream-stream call carrying many requests.

    `entries_of(message)` lists an incoming message's entries and `id_of(entry)` names the
    request each belongs to. `on_broken(error)`, when given, hears the call's end once."""

    def __init__(
        self,
        call: aio.StreamStreamCall,
        entries_of: Callable[[MessageT], Iterable[EntryT]],
        id_of: Callable[[EntryT], str],
        on_broken: Callable[[aio.AioRpcError], None] | None = None,
        batch: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self.call = call
        self.routes: dict[str, Sink[EntryT]] = {}  # open request id -> its sink
        self.broken: aio.AioRpcError | None = None
        self._entries_of = entries_of
        self._id_of = id_of
        self._on_broken = on_broken
        self._batch = batch  # several queued messages -> one (None: each alone)
        # Messages to write, in order, each with the future its writer waits on (None: nobody
        # waits). One writer task writes them (grpc.aio allows one write in flight per call),
        # so a write costs a queue entry, not a task, a lock and a wait of its own.
        self._outgoing: collections.deque[tuple[Any, asyncio.Future[None] | None]] = collections.deque()
        self._writer_idle: asyncio.Future[None] | None = None
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read())
        self._writer = loop.create_task(self._write_all())

    def is_usable(self) -> bool:
        return self.broken is None and not self.call.done()

    async def _read(self) -> None:
        routes = self.routes
        id_of = self._id_of
        try:
            while True:
                message = await self.call.read()
                if message is aio.EOF:
                    self.fail(unavailable("the stream ended early"))
                    return
                for entry in self._entries_of(message):
                    request_id = id_of(entry)
                    sink = routes.get(request_id)
                    # None: its owner closed (or cancelled) it, nobody wants it.
                    if sink is not None and sink.deliver(entry):
                        routes.pop(request_id, None)
        except aio.AioRpcError as error:
            self.fail(error)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the call is unusable; never leave requests hanging
            logger.exception("multiplexed stream reader failed")
            self.fail(unavailable("the connection broke"))

    def fail(self, error: aio.AioRpcError) -> None:
        """Ends the call: every request open on it gets `error`; the owner opens a new one."""
        if self.broken is not None:
            return
        self.broken = error
        if self.routes:
            logger.warning("multiplexed stream broke (%s) with %d requests open",
                           error.code().name, len(self.routes))
        sinks = list(self.routes.values())
        self.routes.clear()
        for sink in sinks:
            sink.fail(copy_error(error))
        self.call.cancel()
        if self._on_broken is not None:
            self._on_broken(error)
        # Writes still queued or in flight on the dead call end now (one can wait forever for
        # initial metadata that a cancelled call never sends: seen when the router was killed
        # under load); their callers get `error` (see `write`).
        while self._outgoing:
            _, written = self._outgoing.popleft()
            if written is not None and not written.done():
                written.set_exception(copy_error(error))
        current = asyncio.current_task()
        for task in (self._reader, self._writer):
            if task is not current:
                task.cancel()

    async def _write_all(self) -> None:
        outgoing = self._outgoing
        waiting: list[asyncio.Future[None] | None] = []  # the callers of the write in flight
        try:
            while True:
                if not outgoing:
                    self._writer_idle = asyncio.get_running_loop().create_future()
                    await self._writer_idle
                    continue
                message, written = outgoing.popleft()
                waiting = [written]
                if self._batch is not None and outgoing:
                    message = self._take_batch(message, waiting)
                await self._write_one(message)
                for written in waiting:
                    if written is not None and not written.done():  # done: its caller was cancelled
                        written.set_result(None)
                waiting = []
        except asyncio.CancelledError:  # `fail` (or `close`) stopped the write in flight
            error = self.broken or unavailable("the connection broke")
            for written in waiting:
                if written is not None and not written.done():
                    written.set_exception(copy_error(error))
            raise
        except aio.AioRpcError as error:
            for written in waiting:
                if written is not None and not written.done():
                    written.set_exception(copy_error(error))

    def _take_batch(self, first: Any, waiting: list[asyncio.Future[None] | None]) -> Any:
        """`first` and the messages queued behind it, in order, as one message while they
        stay within MAX_BATCH_BYTES together; their callers join `waiting`."""
        assert self._batch is not None
        outgoing = self._outgoing
        taken = [first]
        size = first.ByteSize()
        while outgoing:
            size += outgoing[0][0].ByteSize()
            if size > MAX_BATCH_BYTES:
                break
            message, written = outgoing.popleft()
            taken.append(message)
            waiting.append(written)
        return first if len(taken) == 1 else self._batch(taken)

    async def _write_one(self, message: Any) -> None:
        """Writes `message`; on failure fails the call and raises its error."""
        try:
            await self.call.write(message)
        except aio.AioRpcError as error:
            # Request errors travel in-band, so a write that fails with INTERNAL is grpc
            # core's "Internal error from Core": the connection broke (peer killed or
            # restarting) and the caller should retry: UNAVAILABLE.
            mapped = error if error.code() is not grpc.StatusCode.INTERNAL else \
                unavailable("the connection broke")
            self.fail(mapped)
            raise copy_error(mapped) from None
        except asyncio.InvalidStateError:  # the peer ended the call (OK) under the write
            self.fail(unavailable("the stream ended early"))
            raise copy_error(self.broken or unavailable("")) from None

    def _enqueue(self, message: Any, written: asyncio.Future[None] | None) -> None:
        self._outgoing.append((message, written))
        idle = self._writer_idle
        if idle is not None and not idle.done():
            idle.set_result(None)

    async def write(self, message: Any) -> None:
        """Writes `message`; cancelling the caller does not cancel the write (nor the call).
        Raises AioRpcError when the call is broken."""
        if self.broken is not None:
            raise copy_error(self.broken)
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._enqueue(message, written)
        await written  # cancelling this cancels only the future: the message is still written

    async def start(self, request_id: str, message: Any, sink: Sink[EntryT]) -> None:
        """Routes `request_id`'s entries to `sink`, then writes the message that starts it.
        Raises AioRpcError (and routes nothing) when the call cannot take it."""
        if self.broken is not None:
            raise copy_error(self.broken)
        self.routes[request_id] = sink
        try:
            await self.write(message)
        except BaseException:
            if self.routes.get(request_id) is sink:
                del self.routes[request_id]
            raise

    def write_nowait(self, message: Any) -> None:
        """Fire and forget: a failed write means the call broke, which `fail` handled."""
        if self.broken is None:
            self._enqueue(message, None)

    def cancel(self, request_id: str, message: Any) -> bool:
        """Stops routing `request_id` and, when it was still open, writes `message` (its
        cancel) without waiting. -> whether it was open."""
        if self.routes.pop(request_id, None) is None:
            return False
        if self.is_usable():
            self.write_nowait(message)
        return True

    async def close(self, error: aio.AioRpcError | None = None) -> None:
        self.fail(error or aio.AioRpcError(grpc.StatusCode.CANCELLED, aio.Metadata(),
                                           aio.Metadata(), "the stream was closed"))
        tasks = [self._reader, self._writer]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def extend_delta(into: Any, delta: Any) -> None:
    """Merges a ChoiceDelta into an earlier queued one of the same choice (tokens, text and
    logprobs appended in order; the later finish reason wins)."""
    into.token_ids.extend(delta.token_ids)
    into.text += delta.text
    logprobs: MutableSequence[Any] = into.logprobs
    logprobs.extend(delta.logprobs)
    into.finish_reason = delta.finish_reason
