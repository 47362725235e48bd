"""A RemoteSend made before its receiver is known (RemoteSendRequest.kv_addr_follows): the
engine computes the send's KV while the caller makes the receiver's PrepRecv, and the
transfer starts once the receiver's address comes. One shape per way the embedded backend
moves KV: a held send (NIXL reads the pages in place) entered ahead of the write that uses
it, and a chunk stream (shared memory, gRPC) whose first chunk is asked for ahead while its
export waits for the receiver's window."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Generic, TypeVar

from engine_shim.engine.api import KVChunk

T = TypeVar("T")

# Where a chunk of [begin, begin + n) is exported to (AsyncEngine.remote_send's export_into).
ExportInto = Callable[[int, int], object]


class SendNotUsed(Exception):
    """Thrown into a held send that ends without its KV going anywhere."""


class EnteredAhead(AbstractAsyncContextManager[T], Generic[T]):
    """An async context manager entered now, in a task of its own, and used later by
    `async with`, which waits for the enter to end (cancelling that wait cancels the enter:
    the manager cleans up as its own enter does when cancelled). One never used ends with
    `discard`."""

    def __init__(self, manager: AbstractAsyncContextManager[T]) -> None:
        self._manager = manager
        self._entering: asyncio.Future[T] = asyncio.ensure_future(manager.__aenter__())
        self._is_claimed = False

    async def __aenter__(self) -> T:
        self._is_claimed = True
        return await self._entering

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        return await self._manager.__aexit__(exc_type, exc, traceback)

    async def discard(self, *, keep: bool = False) -> None:
        """End it unused. `keep`: wait for the enter and exit cleanly (a held send's pages
        go to the prefix cache); else the enter is cancelled, or the context exits as after
        an error (its pages freed)."""
        if self._is_claimed:
            return
        self._is_claimed = True
        entering = self._entering
        if not keep:
            entering.cancel()
        await asyncio.gather(entering, return_exceptions=True)
        if entering.cancelled() or entering.exception() is not None:
            return  # never entered: the manager cleaned up as its enter failed
        if keep:
            await self._manager.__aexit__(None, None, None)
        else:
            error = SendNotUsed("the send ended before its KV went anywhere")
            await self._manager.__aexit__(SendNotUsed, error, None)


class ChunksAhead:
    """A send's chunk stream (AsyncEngine.remote_send given `window`) whose first chunk is
    asked for now, so the engine starts computing; `set_window` lets the export start,
    `chunks` yields them, `discard` ends one never read."""

    def __init__(self, chunks: AsyncIterator[KVChunk], window: asyncio.Future[tuple[int, ExportInto | None]]):
        self._chunks = chunks
        self._window = window
        self._first: asyncio.Future[KVChunk | None] = asyncio.ensure_future(self._next())

    async def _next(self) -> KVChunk | None:
        try:
            return await anext(self._chunks)
        except StopAsyncIteration:
            return None

    def set_window(self, begin: int, export_into: ExportInto | None) -> None:
        """The receiver's window starts at `begin`; each chunk goes into `export_into`."""
        self._window.set_result((begin, export_into))

    async def chunks(self) -> AsyncIterator[KVChunk]:
        async with contextlib.aclosing(self._chunks):  # type: ignore[type-var]
            first = await self._first
            if first is None:
                return
            yield first
            async for chunk in self._chunks:
                yield chunk

    async def discard(self) -> None:
        """Cancel the computation (its pages freed) when nothing was read."""
        self._first.cancel()
        await asyncio.gather(self._first, return_exceptions=True)
        closing = getattr(self._chunks, "aclose", None)
        if closing is not None:
            await closing()
