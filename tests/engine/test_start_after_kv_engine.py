"""A start that waits in the engine for its reservation's KV (start_generate with after_kv),
two in-process engines: handed over before the KV, it runs nothing until the KV is complete
and starts in the call that completes it (the last pushed chunk, or a write's
finish_kv_write), its tokens one engine's alone; a reservation that ends first (aborted,
expired) fails it FAILED_PRECONDITION with no page left; a second start of the id is refused.
The synthetic engine keeps the same rules."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from engine_test_utils import GREEDY, generate_alone, random_prompt, tokens_of

from engine_shim.backends.synthetic.core import SyntheticCore
from engine_shim.backends.synthetic.profile import StepProfile
from engine_shim.backends.synthetic.transfer import position_stamped_chunk
from engine_shim.engine.api import AlreadyExistsError, FailedPreconditionError, GenerateOutput
from engine_shim.engine.block_manager import slots_for_positions
from engine_shim.engine.config import EngineConfig
from engine_shim.engine.disaggregation import StartFailed
from engine_shim.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.unit


def _failures(events: list, request_id: str) -> list[Exception]:  # type: ignore[type-arg]
    return [e.error for e in events if isinstance(e, StartFailed) and e.request_id == request_id]


@pytest.mark.parametrize("way_in", ["push", "write"])
def test_a_start_made_before_its_kv_runs_once_the_kv_is_complete(
    make_engine: Callable[..., LLMEngine], way_in: str
) -> None:
    single, prefill, decode = (make_engine(kv_export_chunk_tokens=40) for _ in range(3))
    ids = random_prompt(21, 150)
    expected = generate_alone(single, "ref", ids, GREEDY)
    recv = decode.prep_recv("pd", ids, -1)
    if way_in == "write":
        decode.begin_kv_write("pd", time.monotonic() + 60)
    decode.start_generate("pd", ids, recv.end, GREEDY, after_kv=True)
    assert not decode.has_work  # waiting: nothing to step
    with pytest.raises(AlreadyExistsError):
        decode.start_generate("pd", ids, recv.end, GREEDY, after_kv=True)
    chunks = prefill.run_remote_send("pd", ids, recv.prefix_matched_length, recv.end)
    assert len(chunks) > 1
    for chunk in chunks:
        assert not decode.has_work  # still waiting: the KV is not complete
        if way_in == "push":
            decode.import_kv("pd", chunk)
        else:  # what a one-sided write leaves: the pages filled, then its notification
            decode.kv_cache.import_slots(decode_slots(decode, "pd", chunk.begin, chunk.num_tokens), chunk.data)
    if way_in == "write":
        assert not decode.has_work
        decode.finish_kv_write("pd")
    assert decode.has_work  # started in the call that completed the KV
    assert "pd" not in decode.disaggregation.reservations  # the start took it
    assert tokens_of(decode.run_until_done()["pd"]) == expected
    for engine in (single, prefill, decode):
        assert engine.status().num_free_pages == engine.num_pages


def decode_slots(engine: LLMEngine, request_id: str, begin: int, num_tokens: int) -> list[int]:
    reservation = engine.disaggregation.reservations[request_id]
    return slots_for_positions(reservation.block_table, engine.page_size, begin, begin + num_tokens)


@pytest.mark.parametrize("ending", ["abort", "expire"])
def test_a_waiting_start_fails_when_its_reservation_ends_first(
    make_engine: Callable[..., LLMEngine], ending: str
) -> None:
    decode = make_engine()
    ids = random_prompt(22, 60)
    recv = decode.prep_recv("gone", ids, -1, held=ending == "expire")
    decode.start_generate("gone", ids, recv.end, GREEDY, after_kv=True)
    if ending == "abort":
        assert decode.abort("gone")
    else:  # the shim's TTL of a held reservation passed
        assert decode.expire_reservation("gone")
    events = decode.step()
    (error,) = _failures(events, "gone")
    assert isinstance(error, FailedPreconditionError)
    assert "ended before its KV arrived" in str(error)
    assert not any(isinstance(e, GenerateOutput) for e in events)
    assert not decode.has_work
    assert decode.status().num_free_pages == decode.num_pages
    assert decode.status().num_reserved_requests == 0


def test_a_start_after_the_kv_needs_a_reservation_of_its_prompt(make_engine: Callable[..., LLMEngine]) -> None:
    decode = make_engine()
    ids = random_prompt(23, 40)
    with pytest.raises(FailedPreconditionError, match="no open KV reservation"):
        decode.start_generate("none", ids, len(ids) - 1, GREEDY, after_kv=True)
    recv = decode.prep_recv("other", ids, -1)
    with pytest.raises(FailedPreconditionError, match="differs from the prep_recv prompt"):
        decode.start_generate("other", random_prompt(24, 40), recv.end, GREEDY, after_kv=True)
    decode.abort("other")
    assert decode.status().num_free_pages == decode.num_pages


def test_the_synthetic_engine_waits_alike() -> None:
    core = SyntheticCore(EngineConfig(model="tiny", device="cpu"),
                         StepProfile.parse("1:1.03,32:1.33,128:2.01", 120_000), sleep=lambda _: None)
    ids = random_prompt(25, 40, vocab=200)
    recv = core.prep_recv("syn", ids, -1)
    core.start_generate("syn", ids, recv.end, GREEDY, after_kv=True)
    assert "syn" in core._kv_waits and "syn" not in core._requests
    core.import_kv("syn", position_stamped_chunk(0, recv.end))
    assert "syn" in core._requests  # started by the last chunk
    core.abort("syn")
    recv = core.prep_recv("syn-gone", ids, -1)
    core.start_generate("syn-gone", ids, recv.end, GREEDY, after_kv=True)
    core.abort("syn-gone")
    (error,) = _failures(core._take_events(), "syn-gone")
    assert isinstance(error, FailedPreconditionError)
    assert core.num_free_pages == core.num_pages
