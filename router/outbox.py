"""The outgoing side of one Router.Generate stream, shared by all its requests.

Built on `microserving.multiplex.Batcher`: events go into the message being built and the
stream's writer takes everything queued at once (Router.GenerateBatched sends it as one
message; Router.Generate sends its events one by one). A delta goes out as soon as the writer
is free (the first token is never held back); deltas of the same choice that queue up while the
writer waits on the client are merged into the queued one, so a slow reader gets fewer, larger
deltas instead of a growing backlog.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from microserving.multiplex import Batcher, extend_delta
from microserving.v1 import common_pb2, router_pb2


class StreamError(Exception):
    """A stream-level fault (malformed client message): ends the call with INVALID_ARGUMENT."""


class Outbox:
    def __init__(self) -> None:
        self._batcher: Batcher[router_pb2.GenerateBatchedResponse, router_pb2.GenerateResponse] = \
            Batcher(router_pb2.GenerateBatchedResponse, lambda batch: batch.responses)

    @property
    def num_merged(self) -> int:
        return self._batcher.num_merged

    def put(self, request_id: str, **event: Any) -> None:
        """One event (`prompt=`, `finish=`, `done=` or `error=`) of a request."""
        self._batcher.add(request_id=request_id, **event)

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
        entry, is_new = self._batcher.keyed(key, request_id=request_id)
        if is_new:
            entry.delta.CopyFrom(delta)
        else:
            extend_delta(entry.delta, delta)
        if delta.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._batcher.seal(key)  # nothing may merge past a choice's last delta

    def seal(self, request_id: str, num_choices: int) -> None:
        """The request is over: later messages must not merge into its queued deltas."""
        for index in range(num_choices):
            self._batcher.seal((request_id, index))

    def fail(self, error: StreamError) -> None:
        self._batcher.fail(error)

    def close(self) -> None:
        self._batcher.close()

    async def take(self) -> router_pb2.GenerateBatchedResponse | None:
        """Every event queued (waiting for one); None once closed. Raises StreamError for a
        stream fault."""
        return await self._batcher.take()
