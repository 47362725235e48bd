"""One-sided KV writes (the NIXL path) between two in-process engines, without NIXL: P holds
a send's slots, the writer copies them into D's reserved slots by the very descriptors a NIXL
write would use (address, bytes), D completes the reservation; the result equals one engine
alone. A reservation that ends mid-write keeps its pages fenced until the writer's deadline
has passed, whatever ended it."""

from __future__ import annotations

import ctypes
import queue
import time
from collections.abc import Callable

import numpy as np
import pytest
from engine_test_utils import GREEDY, generate_alone, random_prompt, tokens_of

from engine_shim.backends.embedded.kv_plane.nixl import pool_region
from engine_shim.backends.embedded.kv_plane.nixl_descs import (
    descriptors,
    paired_runs,
    segment_slots,
)
from engine_shim.engine.api import InvalidRequestError, NotFoundError, status_from_fields
from engine_shim.engine.block_manager import slot_segments
from engine_shim.engine.core_loop import STOP, Call, CoreLoop
from engine_shim.engine.disaggregation import WRITE_FENCE_MARGIN_S, SendReady
from engine_shim.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.unit


def _held_slots(prefill: LLMEngine, request_id: str, ids: list[int], begin: int, end: int) -> list[int]:
    prefill.remote_send(request_id, ids, begin, end)
    while not any(isinstance(e, SendReady) for e in prefill.step()):
        pass
    return prefill.send_slots(request_id)


def _write_by_descriptors(prefill: LLMEngine, decode: LLMEngine, local: list[int], kv_segments) -> int:
    """Copy as a NIXL WRITE would: row i of the local descriptors onto row i of the remote."""
    local_starts, remote_starts, lengths = paired_runs(
        np.asarray(local, dtype=np.int64), segment_slots(kv_segments)
    )
    source = descriptors(pool_region(prefill.kv_cache.kv), local_starts, lengths)
    target = descriptors(pool_region(decode.kv_cache.kv), remote_starts, lengths)
    for (src, size, _), (dst, dst_size, _) in zip(source, target, strict=True):
        assert size == dst_size
        ctypes.memmove(int(dst), int(src), int(size))
    return len(source)


@pytest.mark.parametrize("shared_tokens", [0, 64])
def test_a_write_by_descriptors_matches_one_engine_alone(
    make_engine: Callable[..., LLMEngine], shared_tokens: int
) -> None:
    single, prefill, decode = (make_engine() for _ in range(3))
    ids = random_prompt(7, 150)
    if shared_tokens:  # D already holds a prefix: only the rest is written (begin > 0)
        generate_alone(decode, "warm", ids[:shared_tokens] + random_prompt(8, 10), GREEDY)
    expected = generate_alone(single, "ref", ids, GREEDY)
    recv = decode.prep_recv("pd", ids, -1)
    assert recv.prefix_matched_length == shared_tokens
    decode.begin_kv_write("pd", time.monotonic() + 60)
    local = _held_slots(prefill, "pd", ids, recv.prefix_matched_length, recv.end)
    num_descriptors = _write_by_descriptors(prefill, decode, local, recv.kv_segments)
    assert num_descriptors % (2 * prefill.model_config.num_layers) == 0
    prefill.finish_remote_send("pd")
    decode.finish_kv_write("pd")
    decode.start_generate("pd", ids, recv.end, GREEDY)
    assert tokens_of(decode.run_until_done()["pd"]) == expected
    for engine in (single, prefill, decode):
        assert engine.status().num_free_pages == engine.num_pages


def test_a_reservation_ended_mid_write_is_fenced_until_the_writers_deadline(
    make_engine: Callable[..., LLMEngine],
) -> None:
    decode = make_engine(reservation_ttl_s=5.0)
    ids = random_prompt(9, 100)
    recv = decode.prep_recv("w", ids, -1)
    held = decode.status().num_free_pages
    now = time.monotonic()
    write_ends_at = now + 100.0
    decode.begin_kv_write("w", write_ends_at)
    # A write holds the reservation past its TTL (its end is the receiving shim's: it aborts
    # once the writer's deadline passed without the notification).
    assert decode.reap_expired_reservations(now + 10.0) == []
    assert decode.abort("w")
    status = decode.status()
    assert status.num_reserved_requests == 0  # the id is free again at once
    assert status.num_free_pages == held < decode.num_pages  # but not the pages
    assert decode.next_deadline() == pytest.approx(write_ends_at + WRITE_FENCE_MARGIN_S)
    decode.reap_expired_reservations(write_ends_at)  # the writer may still be landing
    assert decode.status().num_free_pages == held
    decode.reap_expired_reservations(write_ends_at + WRITE_FENCE_MARGIN_S)
    assert decode.status().num_free_pages == decode.num_pages
    assert decode.next_deadline() is None
    assert recv.end == len(ids) - 1


def test_a_reservation_without_a_write_is_freed_at_once(make_engine) -> None:
    decode = make_engine()
    decode.prep_recv("plain", random_prompt(10, 100), -1)
    with pytest.raises(NotFoundError):
        decode.finish_kv_write("plain")  # no write began
    decode.abort("plain")
    assert decode.status().num_free_pages == decode.num_pages


def test_kv_segments_pair_into_runs_consecutive_on_both_sides() -> None:
    local = np.array([0, 1, 2, 3, 8, 9, 10, 11], dtype=np.int64)
    remote = segment_slots([2, 32, 6, 40, 2])  # 32..37, 40..41
    local_starts, remote_starts, lengths = paired_runs(local, remote)
    assert local_starts.tolist() == [0, 8, 10]
    assert remote_starts.tolist() == [32, 36, 40]
    assert lengths.tolist() == [4, 2, 2]
    assert slot_segments(remote.tolist()) == [(32, 6), (40, 2)]


@pytest.mark.parametrize("segments", [[], [2, 0, 4], [1, -1, 4], [1, 3, 0]])
def test_malformed_kv_segments_are_invalid(segments: list[int]) -> None:
    with pytest.raises(InvalidRequestError):
        segment_slots(segments)


def test_a_sender_holding_other_than_the_reserved_count_is_invalid() -> None:
    with pytest.raises(InvalidRequestError):
        paired_runs(np.arange(3, dtype=np.int64), np.arange(4, dtype=np.int64))


def test_a_write_holds_its_reservation_and_its_end_restarts_the_ttl(
    make_engine: Callable[..., LLMEngine],
) -> None:
    decode = make_engine(reservation_ttl_s=5.0)
    decode.prep_recv("w", random_prompt(11, 100), -1)
    started = time.monotonic()
    decode.begin_kv_write("w", started + 60.0)
    assert decode.next_deadline() is None  # held: no expiry to wake for
    assert decode.reap_expired_reservations(started + 30.0) == []
    decode.finish_kv_write("w")
    deadline = decode.next_deadline()
    assert deadline is not None and deadline >= started + 5.0  # the TTL counts from the end
    assert decode.reap_expired_reservations(deadline + 0.1) == ["w"]
    assert decode.status().num_free_pages == decode.num_pages  # written, never started: freed


class _Inbox:
    """core_loop.Inbox over a queue.Queue (as the thread driver's)."""

    def __init__(self, *items: Call | str) -> None:
        self._queue: queue.Queue[Call | str] = queue.Queue()
        for item in items:
            self._queue.put(item)

    def get(self, timeout: float | None) -> Call | str:
        return self._queue.get_nowait() if timeout is None else self._queue.get(timeout=timeout)


def test_a_call_nobody_waits_for_still_publishes_the_status(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """A send's release and an abort go to the core without a caller waiting (their RESULT is
    not sent); the status must still go out once they ran, or GetStatus keeps reporting the
    pages they freed as held until something else happens."""
    engine = make_engine()
    engine.prep_recv("r", random_prompt(12, 100), -1)
    assert engine.status().num_free_pages < engine.num_pages
    published: list[int] = []
    inbox = _Inbox(Call(None, "abort", ("r",)), STOP)
    CoreLoop(engine, inbox,
             lambda _batch, fields: published.append(status_from_fields(engine.status(), fields)
                                                     .num_free_pages)).run()
    assert published and published[-1] == engine.num_pages


def test_a_write_given_up_before_it_started_leaves_nothing_fenced(make_engine) -> None:
    """cancel_kv_write: the writer says it wrote nothing (it claimed while its engine computed,
    then gave up). No write is in flight any more, so an abort frees the pages at once; the
    reservation stays, held while the sender's hold is open, else with its TTL restarted."""
    decode = make_engine(reservation_ttl_s=5.0)
    decode.prep_recv("early", random_prompt(11, 100), -1)
    with pytest.raises(NotFoundError):
        decode.cancel_kv_write("early", True)  # no write began
    now = time.monotonic()
    decode.begin_kv_write("early", now + 100.0)
    decode.cancel_kv_write("early", True)
    assert decode.reap_expired_reservations(now + 10.0) == []  # held
    decode.begin_kv_write("early", now + 100.0)  # claimed again, given up again
    decode.cancel_kv_write("early", False)
    assert decode.next_deadline() == pytest.approx(time.monotonic() + 5.0, abs=1.0)
    assert decode.abort("early")
    assert decode.status().num_free_pages == decode.num_pages  # not fenced
    assert decode.next_deadline() is None
