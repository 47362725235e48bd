"""The outgoing side of one Router.Generate stream, shared by all its requests.

Token relay: a delta goes out as soon as the writer is free (the first token is never held
back); deltas of the same choice that queue up while the writer waits on the client are
merged into the one queued message, so a slow reader gets fewer, larger messages instead of
a growing backlog.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable

from microserving.v1 import common_pb2, router_pb2


class StreamError(Exception):
    """A stream-level fault (malformed client message): ends the call with INVALID_ARGUMENT."""


_END = object()


class Outbox:
    def __init__(self) -> None:
        self._queue: deque[object] = deque()
        self._pending: dict[tuple[str, int], router_pb2.GenerateResponse] = {}
        self._waiter: asyncio.Future[None] | None = None  # the writer, waiting for a message
        self.num_merged = 0

    def _append(self, item: object) -> None:
        self._queue.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def put(self, response: router_pb2.GenerateResponse) -> None:
        self._append(response)

    def put_delta(
        self,
        request_id: str,
        index: int,
        token_ids: Iterable[int],
        text: str,
        logprobs: Iterable[common_pb2.TokenLogprob] = (),
        finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED,
    ) -> None:
        self.put_choice_delta(request_id, common_pb2.ChoiceDelta(
            index=index, token_ids=token_ids, text=text, logprobs=logprobs,
            finish_reason=finish_reason,  # type: ignore[arg-type]
        ))

    def put_choice_delta(self, request_id: str, delta: common_pb2.ChoiceDelta) -> None:
        """Queue `delta` (copied: an engine's message can be relayed as it is), or merge it
        into the choice's delta still waiting for the writer."""
        key = (request_id, delta.index)
        queued = self._pending.get(key)
        if queued is not None:
            merged = queued.delta
            merged.token_ids.extend(delta.token_ids)
            merged.text += delta.text
            merged.logprobs.extend(delta.logprobs)
            merged.finish_reason = delta.finish_reason
            self.num_merged += 1
        else:
            queued = router_pb2.GenerateResponse(request_id=request_id, delta=delta)
            self._append(queued)
            self._pending[key] = queued
        if delta.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._pending.pop(key, None)  # nothing may merge past a choice's last delta

    def seal(self, request_id: str, num_choices: int) -> None:
        """The request is over: later messages must not merge into its queued deltas."""
        for index in range(num_choices):
            self._pending.pop((request_id, index), None)

    def fail(self, error: StreamError) -> None:
        self._append(error)

    def close(self) -> None:
        self._append(_END)

    async def get(self) -> router_pb2.GenerateResponse | None:
        """The next message; None once closed. Raises StreamError for a stream fault."""
        while not self._queue:
            # One future per wait (cheaper than an asyncio.Event's on the token path).
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._queue.popleft()
        if item is _END:
            return None
        if isinstance(item, StreamError):
            raise item
        assert isinstance(item, router_pb2.GenerateResponse)  # only these are queued
        if item.HasField("delta"):
            key = (item.request_id, item.delta.index)
            if self._pending.get(key) is item:
                del self._pending[key]
        return item
