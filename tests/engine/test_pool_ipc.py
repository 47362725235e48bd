"""A NIXL write as copies into the receiver's pool mapped in the sender's process
(kv_plane/pool_ipc.py): the copies move exactly the paired runs of slots and refuse slots
outside either pool; the offer's mapping travels in kv_addr_info and is covered by the write
digest; a pool in host memory is never offered nor mapped. With two real engines and two real
NIXL agents in this process (UCX over host memory), a write into a peer's pool held here lands
as copies plus NIXL's notification, and the receiver completes the reservation exactly as for
a NIXL transfer: the decode equals one engine alone; a mapping the sender cannot open leaves
the write to NIXL's transfer, and a mapping left unused is dropped (these skip where NIXL
cannot load). CUDA IPC itself (mapping another process's device pool) runs in tests/gpu,
where two shim processes share one GPU."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from engine_test_utils import GREEDY, generate_alone, poll_sides, random_prompt, tokens_of

from engine_shim.backends.embedded.kv_plane.addr import KVAddrInfo, NixlOffer, PoolMapping
from engine_shim.backends.embedded.kv_plane.nixl import MAPPING_IDLE_S, HeldSlots
from engine_shim.backends.embedded.kv_plane.nixl_core import NixlSide
from engine_shim.backends.embedded.kv_plane.nixl_descs import PoolRegion, segment_slots
from engine_shim.backends.embedded.kv_plane.pool_ipc import (
    copy_runs,
    export_pool,
    open_pool,
    slot_view,
)
from engine_shim.engine.api import InvalidRequestError, KVLayout
from engine_shim.engine.disaggregation import SendReady
from engine_shim.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.unit

MAPPING = PoolMapping(
    host="boot/host", pid=4242, device_uuid="GPU-1", handle="aGFuZGxl", storage_bytes=1 << 20,
    storage_offset=0, ref_counter_handle="cmVm", ref_counter_offset=3, event_handle="",
    event_sync_required=False, pool_offset=0,
)


def test_copies_move_exactly_the_paired_runs() -> None:
    src = torch.randint(0, 256, (4, 32, 8), dtype=torch.uint8)
    dst = torch.zeros((4, 40, 8), dtype=torch.uint8)
    local = np.array([3, 4, 5, 10, 11, 12], dtype=np.int64)
    remote = np.array([20, 21, 22, 23, 7, 8], dtype=np.int64)  # runs break on one side only
    assert copy_runs(dst, src, local, remote) == 6 * 4 * 8
    for mine, theirs in zip(local.tolist(), remote.tolist(), strict=True):
        assert torch.equal(dst[:, theirs], src[:, mine])
    untouched = sorted(set(range(40)) - set(remote.tolist()))
    assert not dst[:, untouched].any()


@pytest.mark.parametrize("local, remote", [([30, 31, 32], [0, 1, 2]), ([0, 1, 2], [38, 39, 40]),
                                           ([-1], [0])])
def test_copies_refuse_slots_outside_either_pool_before_copying_any(local: list[int], remote: list[int]) -> None:
    src = torch.ones((2, 32, 4), dtype=torch.uint8)
    dst = torch.zeros((2, 40, 4), dtype=torch.uint8)
    with pytest.raises(InvalidRequestError, match="outside the pool"):
        copy_runs(dst, src, np.array(local, dtype=np.int64), np.array(remote, dtype=np.int64))
    assert not dst.any()


def _addr(mapping: PoolMapping | None) -> KVAddrInfo:
    offer = NixlOffer(agent="d", metadata="bWQ=", mem_type="VRAM", device_id=0, base=4096,
                      num_planes=4, plane_bytes=4096, slot_bytes=64, mapping=mapping)
    layout = KVLayout(model_fingerprint="tiny", dtype="float32", num_layers=2, num_kv_heads=1,
                      head_dim=16, page_size=16)
    return KVAddrInfo(address="127.0.0.1:1", request_id="r", reservation_token="t", begin=0,
                      end=16, kv_segments=(1, 0, 16), layout=layout, nixl=offer)


def test_the_mapping_travels_in_kv_addr_info_and_the_write_digest_covers_it() -> None:
    addr = _addr(MAPPING)
    assert KVAddrInfo.decode(addr.encode()) == addr
    other = _addr(dataclasses.replace(MAPPING, handle="b3RoZXI="))
    assert other.write_digest() != addr.write_digest()
    assert _addr(None).write_digest() != addr.write_digest()
    # An offer from a receiver that makes none (older, or on the CPU) decodes without one.
    assert KVAddrInfo.decode(_addr(None).encode()).nixl.mapping is None  # type: ignore[union-attr]


def test_host_memory_is_neither_offered_nor_mapped() -> None:
    pool = torch.zeros((2, 2, 8, 1, 4))
    assert export_pool(pool) is None
    region = PoolRegion(pool.data_ptr(), 4, 8 * 16, 16, 0)
    assert open_pool(MAPPING, region, pool) is None
    view = slot_view(pool, region)  # 8-byte words: a copy moves 8 bytes an element
    assert view.shape == (4, 8, 2) and view.dtype == torch.int64
    assert view.data_ptr() == pool.data_ptr()


def _write_by_an_offer_with_a_mapping(
    nixl_pair: tuple[LLMEngine, NixlSide, LLMEngine, NixlSide], ids: list[int], tag: bytes,
    receiver_pool_here: bool,
) -> tuple[list[tuple], NixlOffer, Callable[[], list[int]]]:
    """P's NIXL write of `ids`' KV into D's reservation, by D's offer with a mapping added
    (pools in host memory offer none); with `receiver_pool_here`, D's pool is what mapping
    the offer gives P (the engines share this process; CUDA IPC itself runs in tests/gpu).
    -> (both sides' events until the write ended and its notification came, the offer,
    D's decode of the request once P has let its send go)."""
    prefill, p_side, decode, d_side = nixl_pair
    d_offer, p_offer = d_side.facts()[0], p_side.facts()[0]
    assert d_offer is not None and p_offer is not None
    assert d_offer.mapping is None and p_offer.mapping is None  # CPU pools: nothing to map
    offer = dataclasses.replace(d_offer, mapping=MAPPING)
    recv = decode.prep_recv("pd", ids, -1)
    decode.begin_kv_write("pd", time.monotonic() + 60)
    d_side.call("nixl_expect", (tag, p_offer.agent, "pd"))
    assert p_side.call("nixl_load_peer", (offer,)) == offer.agent
    if receiver_pool_here:
        agent = p_side._agent
        assert agent is not None
        agent._mapped[offer.agent] = (slot_view(decode.kv_cache.kv, agent.region), time.monotonic())
    prefill.remote_send("pd", ids, recv.prefix_matched_length, recv.end)
    while not any(isinstance(e, SendReady) for e in prefill.step()):
        pass
    p_side.call("nixl_write", (1, offer, HeldSlots("pd", 0), segment_slots(recv.kv_segments), tag,
                               time.monotonic() + 60))
    events = poll_sides(p_side, d_side, until=lambda seen: len(seen) == 2)

    def decoded() -> list[int]:
        prefill.finish_remote_send("pd")
        decode.start_generate("pd", ids, recv.end, GREEDY)
        return tokens_of(decode.run_until_done()["pd"])

    return events, offer, decoded


def test_a_write_into_a_mapped_pool_lands_as_copies_and_the_notification(
    make_engine: Callable[..., LLMEngine], nixl_pair
) -> None:
    _, p_side, _, _ = nixl_pair
    ids = random_prompt(23, 100)
    expected = generate_alone(make_engine(), "ref", ids, GREEDY)
    tag = b"reservation-token"
    events, _, decoded = _write_by_an_offer_with_a_mapping(nixl_pair, ids, tag, receiver_pool_here=True)
    sender = p_side.facts()[0].agent
    assert sorted(events) == [("notif", sender, tag, ""), ("write", 1, "DONE", "")]
    # Its notification went out on its own: the sender's agent progresses for it until the
    # receiver's confirmation (nixl_sender -> plane.landed), then rests.
    assert p_side.is_busy
    p_side.call("nixl_landed", (tag,))
    assert not p_side.is_busy
    assert decoded() == expected


def test_an_offered_mapping_that_cannot_be_opened_here_is_written_through_nixl(
    make_engine: Callable[..., LLMEngine], nixl_pair
) -> None:
    """A receiver's mapping this process cannot open (here: the sender's pool is in host
    memory; elsewhere another host or GPU) leaves the write to NIXL's transfer, which
    lands the KV as ever; the mapping is not tried again for that peer."""
    _, p_side, _, _ = nixl_pair
    ids = random_prompt(29, 90)
    expected = generate_alone(make_engine(), "ref", ids, GREEDY)
    tag = b"token-nixl"
    events, offer, decoded = _write_by_an_offer_with_a_mapping(nixl_pair, ids, tag, receiver_pool_here=False)
    sender = p_side.facts()[0].agent
    assert sorted(events) == [("notif", sender, tag, ""), ("write", 1, "DONE", "")]
    agent = p_side._agent
    assert agent is not None and agent._mapped[offer.agent][0] is None
    assert not p_side.is_busy  # NIXL's transfer carried the notification: nothing to progress
    assert decoded() == expected


def test_a_mapping_unused_for_its_idle_time_is_dropped_at_the_next_lookup(nixl_pair) -> None:
    """A receiver that went away leaves no mapping of its memory behind for good: a peer's
    pool not written for MAPPING_IDLE_S is unmapped when the next write looks one up."""
    _, p_side, _, d_side = nixl_pair
    agent = p_side._agent
    d_offer = d_side.facts()[0]
    assert agent is not None and d_offer is not None
    stale = torch.zeros(4, 8, 2, dtype=torch.int64)
    agent._mapped["gone"] = (stale, time.monotonic() - MAPPING_IDLE_S - 1)
    agent._mapped["recent"] = (stale, time.monotonic())
    agent._peer_pool(dataclasses.replace(d_offer, mapping=MAPPING))
    assert set(agent._mapped) == {"recent", d_offer.agent}
