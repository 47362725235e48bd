"""microserving.multiplex.Batcher, the sending end every multiplexed stream shares: one message
per writer turn, entries merged by key, the stream interval, and urgent entries."""

from __future__ import annotations

import asyncio

import pytest

from microserving.multiplex import Batcher
from microserving.v1 import engine_pb2

pytestmark = pytest.mark.unit


def _batcher(min_interval_s: float = 0.0) -> Batcher[engine_pb2.EngineGenerateResponse, engine_pb2.GenerateOutput]:
    return Batcher(engine_pb2.EngineGenerateResponse, lambda batch: batch.outputs,
                   min_interval_s=min_interval_s)


def _add(batcher: Batcher[engine_pb2.EngineGenerateResponse, engine_pb2.GenerateOutput],
         request_id: str, token: int, urgent: bool = False) -> None:
    entry, _ = batcher.keyed(request_id, urgent=urgent, request_id=request_id)
    entry.choices.add(index=0, token_ids=[token])


def _tokens(batch: engine_pb2.EngineGenerateResponse | None) -> dict[str, list[int]]:
    assert batch is not None
    return {o.request_id: [t for c in o.choices for t in c.token_ids] for o in batch.outputs}


async def test_everything_queued_goes_in_one_message_one_entry_per_key() -> None:
    batcher = _batcher()
    for token in range(3):
        _add(batcher, "a", token)
        _add(batcher, "b", 10 + token)
    assert _tokens(await batcher.take()) == {"a": [0, 1, 2], "b": [10, 11, 12]}
    assert batcher.num_merged == 4 and batcher.num_messages == 1
    _add(batcher, "a", 3)  # a new message: a new entry
    assert _tokens(await batcher.take()) == {"a": [3]}


async def test_a_sealed_or_discarded_key_gets_nothing_merged() -> None:
    batcher = _batcher()
    _add(batcher, "a", 1)
    batcher.seal("a")
    _add(batcher, "a", 2)
    _add(batcher, "b", 7)
    batcher.discard("b")
    batch = await batcher.take()
    assert batch is not None and [[t for c in o.choices for t in c.token_ids] for o in batch.outputs] == [[1], [2]]


async def test_the_interval_merges_what_comes_within_it_and_urgent_entries_skip_it() -> None:
    batcher = _batcher(min_interval_s=0.5)
    _add(batcher, "a", 1)
    assert _tokens(await batcher.take()) == {"a": [1]}  # nothing sent before: no wait
    taker = asyncio.ensure_future(batcher.take())
    for token in range(2, 6):  # within the interval: all wait for the next message
        _add(batcher, "a", token)
        await asyncio.sleep(0)
    assert not taker.done()
    assert _tokens(await taker) == {"a": [2, 3, 4, 5]}


async def test_an_urgent_entry_does_not_wait_for_the_interval() -> None:
    batcher = _batcher(min_interval_s=600.0)
    _add(batcher, "a", 1)
    assert await batcher.take() is not None
    taker = asyncio.ensure_future(batcher.take())
    _add(batcher, "a", 2)
    await asyncio.sleep(0.05)
    assert not taker.done()  # 600 s to go
    _add(batcher, "b", 1, urgent=True)  # a request's first output: out as soon as possible
    assert _tokens(await asyncio.wait_for(taker, 60)) == {"a": [2], "b": [1]}


async def test_close_hands_out_what_is_queued_then_none_and_fail_raises() -> None:
    batcher = _batcher(min_interval_s=10.0)
    _add(batcher, "a", 1)
    assert await batcher.take() is not None
    _add(batcher, "a", 2)
    batcher.close()  # a closing stream never waits out its interval
    assert _tokens(await batcher.take()) == {"a": [2]}
    assert await batcher.take() is None
    failing = _batcher()
    failing.fail(RuntimeError("stream broke"))
    with pytest.raises(RuntimeError, match="stream broke"):
        await failing.take()
