"""The NIXL agent beside the engine core (nixl_core.NixlSide) with two real engines and two
real NIXL agents in this process (UCX over host memory): a write of a send that is still
computing waits in the core (parked) and is posted in the first poll after the send's KV is
written, landing exactly the KV one engine alone computes; a parked write whose send ends
first, or whose deadline passes, ends NOT_STARTED without posting anything; a parked write
cancelled from the shim reports that nothing was posted. Skipped where NIXL cannot load."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from engine_test_utils import GREEDY, generate_alone, poll_sides, random_prompt, tokens_of

from engine_shim.backends.embedded.kv_plane.nixl import HeldSlots, load_nixl
from engine_shim.backends.embedded.kv_plane.nixl_core import NOT_STARTED
from engine_shim.backends.embedded.kv_plane.nixl_descs import segment_slots
from engine_shim.engine.disaggregation import SendReady
from engine_shim.engine.llm_engine import LLMEngine

NIXL, WHY_NOT = load_nixl()
pytestmark = [pytest.mark.unit, pytest.mark.skipif(NIXL is None, reason=WHY_NOT)]


def test_a_write_parked_before_the_kv_is_computed_lands_once_it_is(
    make_engine: Callable[..., LLMEngine], nixl_pair
) -> None:
    prefill, p_side, decode, d_side = nixl_pair
    ids = random_prompt(21, 120)
    expected = generate_alone(make_engine(), "ref", ids, GREEDY)
    recv = decode.prep_recv("pd", ids, -1)
    decode.begin_kv_write("pd", time.monotonic() + 60)
    offer = d_side.facts()[0]
    assert offer is not None
    tag = b"reservation-token"
    d_side.call("nixl_expect", (tag, p_side.facts()[0].agent, "pd"))  # type: ignore[union-attr]
    assert p_side.call("nixl_load_peer", (offer,)) == offer.agent
    prefill.remote_send("pd", ids, recv.prefix_matched_length, recv.end)
    remote = segment_slots(recv.kv_segments)
    # The write comes before the engine computed anything: it waits, nothing posted.
    p_side.call("nixl_write", (1, offer, HeldSlots("pd", 0), remote, tag, time.monotonic() + 60))
    assert p_side.is_busy and p_side.poll() == []
    while not any(isinstance(e, SendReady) for e in prefill.step()):
        assert p_side.poll() == []  # still computing: still parked
    # Posted in the first poll after: it ends, and the receiver's side completes the
    # reservation in its engine on the notification.
    sender = p_side.facts()[0].agent  # type: ignore[union-attr]
    events = poll_sides(p_side, d_side, until=lambda seen: len(seen) == 2)
    assert sorted(events) == [("notif", sender, tag, ""), ("write", 1, "DONE", "")]
    prefill.finish_remote_send("pd")
    decode.start_generate("pd", ids, recv.end, GREEDY)
    assert tokens_of(decode.run_until_done()["pd"]) == expected
    assert not p_side.is_busy


def test_writes_whose_sends_one_step_computes_are_posted_in_one_poll_and_all_land(
    make_engine: Callable[..., LLMEngine], nixl_pair
) -> None:
    """A prefill step that computes several sends' KV posts their parked writes in one poll
    (checked together there, one window for all: nixl_core._spin_fresh); each lands in its
    own reservation, exactly what one engine alone computes for its prompt."""
    prefill, p_side, decode, d_side = nixl_pair
    offer = d_side.facts()[0]
    sender = p_side.facts()[0].agent  # type: ignore[union-attr]
    assert offer is not None
    assert p_side.call("nixl_load_peer", (offer,)) == offer.agent
    prompts = {f"wave-{i}": random_prompt(40 + i, 70 + 9 * i) for i in range(4)}
    expected = {rid: generate_alone(make_engine(), rid, ids, GREEDY) for rid, ids in prompts.items()}
    ends = {}
    for xfer_id, (rid, ids) in enumerate(prompts.items(), start=1):
        recv = decode.prep_recv(rid, ids, -1)
        decode.begin_kv_write(rid, time.monotonic() + 60)
        tag = f"tag-{rid}".encode()
        d_side.call("nixl_expect", (tag, sender, rid))
        prefill.remote_send(rid, ids, recv.prefix_matched_length, recv.end)
        p_side.call("nixl_write", (xfer_id, offer, HeldSlots(rid, 0), segment_slots(recv.kv_segments),
                                   tag, time.monotonic() + 60))
        ends[rid] = recv.end
    assert p_side.poll() == []  # all four parked: nothing computed yet
    ready: set[str] = set()
    while len(ready) < len(prompts):
        ready |= {e.request_id for e in prefill.step() if isinstance(e, SendReady)}
    assert ready == set(prompts)
    events = poll_sides(p_side, d_side, until=lambda seen: len(seen) == 2 * len(prompts))
    assert sorted(events) == sorted(
        [("notif", sender, f"tag-{rid}".encode(), "") for rid in prompts]
        + [("write", xfer_id, "DONE", "") for xfer_id in range(1, len(prompts) + 1)])
    for rid, ids in prompts.items():
        prefill.finish_remote_send(rid)
        decode.start_generate(rid, ids, ends[rid], GREEDY)
    outputs = decode.run_until_done()
    assert {rid: tokens_of(outputs[rid]) for rid in prompts} == expected
    assert not p_side.is_busy


@pytest.mark.parametrize("ending", ["send aborted", "deadline passed", "cancelled"])
def test_a_parked_write_that_cannot_start_posts_nothing(nixl_pair, ending: str) -> None:
    prefill, p_side, decode, d_side = nixl_pair
    ids = random_prompt(22, 80)
    recv = decode.prep_recv("gone", ids, -1)
    offer = d_side.facts()[0]
    assert offer is not None
    p_side.call("nixl_load_peer", (offer,))
    prefill.remote_send("gone", ids, 0, recv.end)
    deadline = time.monotonic() + (0.05 if ending == "deadline passed" else 60)
    p_side.call("nixl_write", (7, offer, HeldSlots("gone", 0), segment_slots(recv.kv_segments),
                               b"t", deadline))
    if ending == "cancelled":
        assert p_side.call("nixl_cancel", (7,)) is True  # it was parked: nothing posted
        assert p_side.poll() == [] and not p_side.is_busy
        return
    if ending == "send aborted":
        prefill.abort("gone")
    else:
        time.sleep(0.1)
    [event] = poll_sides(p_side, until=bool)
    assert event[:3] == ("write", 7, NOT_STARTED)
    assert not p_side.is_busy


def test_a_peer_dropped_while_writes_to_it_run_is_dropped_after_them_and_reloaded_by_the_next(
    make_engine: Callable[..., LLMEngine], nixl_pair
) -> None:
    """A failed write drops its peer (it may have restarted), but other writes to it may
    still run: removing the peer under them failed them all (NIXL_ERR_NOT_FOUND), each failure
    dropping it again. The drop waits for the transfers still open, and a write to a dropped
    peer loads it again from the offer it carries."""
    prefill, p_side, decode, d_side = nixl_pair
    offer = d_side.facts()[0]
    sender = p_side.facts()[0].agent  # type: ignore[union-attr]
    assert offer is not None
    assert p_side.call("nixl_load_peer", (offer,)) == offer.agent
    agent = p_side._agent
    assert agent is not None

    def write(xfer_id: int, request_id: str, ids: list[int]) -> tuple[bytes, list[int]]:
        recv = decode.prep_recv(request_id, ids, -1)
        decode.begin_kv_write(request_id, time.monotonic() + 60)
        tag = f"tag-{request_id}".encode()
        d_side.call("nixl_expect", (tag, sender, request_id))
        prefill.remote_send(request_id, ids, recv.prefix_matched_length, recv.end)
        while not any(isinstance(e, SendReady) for e in prefill.step()):
            pass
        remote = segment_slots(recv.kv_segments)
        p_side.call("nixl_write", (xfer_id, offer, HeldSlots(request_id, 0), remote, tag,
                                   time.monotonic() + 60))
        return tag, [recv.end]

    tag_1, _ = write(1, "first", random_prompt(31, 90))
    # The peer is dropped (another write to it failed) while this one is still open here.
    p_side.call("nixl_drop_peer", (offer.agent,))
    events = poll_sides(p_side, d_side, until=lambda seen: len(seen) == 2)
    assert sorted(events) == [("notif", sender, tag_1, ""), ("write", 1, "DONE", "")]
    assert offer.agent not in agent._peers  # dropped once the write was released
    # The next write loads the peer again from its offer, and lands.
    tag_2, _ = write(2, "second", random_prompt(32, 90))
    events = poll_sides(p_side, d_side, until=lambda seen: len(seen) == 2)
    assert sorted(events) == [("notif", sender, tag_2, ""), ("write", 2, "DONE", "")]
    for request_id in ("first", "second"):
        prefill.finish_remote_send(request_id)
