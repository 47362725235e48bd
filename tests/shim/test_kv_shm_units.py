"""The shared-memory stage's parts on their own (real memfd segments, this process as both
receiver and sender): leases are reused after a completed push and retired otherwise, a
stage offered beside a NIXL write is not backed until a lease needs it, the budget holds, a sender maps only a receiver's genuine segment, both sides address the same
bytes, and kv_addr_info carries the offer."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from engine_shim.backends.embedded.kv_plane.addr import KVAddrInfo
from engine_shim.backends.embedded.kv_plane.codec import bytes_per_token, staged_chunk
from engine_shim.backends.embedded.kv_plane.shm import (
    HEADER_BYTES,
    MIN_SEGMENT_BYTES,
    SegmentMaps,
    StagingPool,
    host_identity,
    stage_fds,
)
from engine_shim.engine.api import InvalidRequestError, KVLayout

pytestmark = pytest.mark.skipif(host_identity() is None, reason="needs memfd and /proc (Linux)")

LAYOUT = KVLayout("fp", "float32", num_layers=2, num_kv_heads=1, head_dim=4, page_size=16)
HOST = host_identity() or ""


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    staging = StagingPool(max_bytes=4 * MIN_SEGMENT_BYTES)
    yield staging
    staging.close()


def test_a_cleanly_returned_segment_is_reused_and_a_broken_one_retired(pool):
    first = pool.lease(1000)
    assert first is not None and first.fd in stage_fds(os.getpid())
    pool.give_back(first, is_clean=True)
    again = pool.lease(2000)
    assert again is first
    fd = first.fd
    pool.give_back(again, is_clean=False)
    assert first.fd == -1 and fd not in stage_fds(os.getpid())  # closed: no sender opens it
    fresh = pool.lease(1000)
    assert fresh is not None and fresh is not first


def _allocated_bytes(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def test_a_stage_offered_beside_a_nixl_write_is_backed_only_when_a_lease_needs_it(pool):
    unbacked = pool.lease(MIN_SEGMENT_BYTES - HEADER_BYTES, backed=False)
    assert unbacked is not None and not unbacked.is_backed
    assert _allocated_bytes(unbacked.fd) < MIN_SEGMENT_BYTES // 2  # the nonce's page at most
    pool.give_back(unbacked, is_clean=True)
    again = pool.lease(100)  # a reservation without NIXL: the free segment, backed now
    assert again is unbacked and again.is_backed
    assert _allocated_bytes(again.fd) >= MIN_SEGMENT_BYTES
    backed = pool.lease(100)
    assert backed is not None and backed.is_backed
    assert _allocated_bytes(backed.fd) >= MIN_SEGMENT_BYTES


def test_a_window_of_a_power_of_two_takes_a_segment_of_its_size_and_one_page(pool):
    exact = pool.lease(2 * MIN_SEGMENT_BYTES - 2 * HEADER_BYTES)  # 2 MiB of KV
    assert exact is not None and exact.size == HEADER_BYTES + 2 * (MIN_SEGMENT_BYTES - HEADER_BYTES)
    small = pool.lease(1000)
    assert small is not None and small.size == MIN_SEGMENT_BYTES


def test_leases_stop_at_the_budget_and_free_segments_make_room(pool):
    leased = [pool.lease(MIN_SEGMENT_BYTES - HEADER_BYTES) for _ in range(4)]
    assert all(s is not None for s in leased)
    assert len({s.fd for s in leased if s is not None}) == 4  # one segment per reservation
    assert pool.lease(100) is None  # over budget: this reservation gets gRPC only
    assert leased[0] is not None
    pool.give_back(leased[0], is_clean=True)
    bigger = pool.lease(MIN_SEGMENT_BYTES)  # needs 2 MiB: the free 1 MiB one is evicted
    assert bigger is None  # 3 leased + 2 MiB > 4 MiB
    assert leased[0].fd == -1


def test_close_releases_every_segment():
    staging = StagingPool(max_bytes=1 << 30)
    segments = [staging.lease(10), staging.lease(10)]
    assert all(s is not None for s in segments)
    offered = [s.fd for s in segments if s is not None]
    staging.give_back(segments[0], is_clean=True)  # type: ignore[arg-type]
    assert set(offered) <= set(stage_fds(os.getpid()))
    staging.close()
    assert not set(offered) & set(stage_fds(os.getpid()))  # no sender can open them now
    del segments  # the last references: the mappings (and the memory) go with them
    assert stage_fds(os.getpid()) == []


@pytest.mark.parametrize("backed", [True, False])  # unbacked: a stage offered beside NIXL
def test_the_sender_writes_the_bytes_the_receiver_reads(pool, backed):
    per_token = bytes_per_token(LAYOUT)
    segment = pool.lease(10 * per_token, backed=backed)
    assert segment is not None
    maps = SegmentMaps(HOST)
    try:
        stage = maps.open(segment.offer(HOST), 10 * per_token)
        assert stage is not None
        sent = torch.randn(2, 2, 4, 1, 4)
        staged_chunk(stage, 100, 104, 4, LAYOUT).copy_(sent)
        assert torch.equal(staged_chunk(segment.data, 100, 104, 4, LAYOUT), sent)
    finally:
        maps.close()


def test_a_sender_maps_only_the_receivers_genuine_segment(pool):
    segment = pool.lease(1000)
    assert segment is not None
    offer = segment.offer(HOST)
    maps = SegmentMaps(HOST)
    try:
        with tempfile.TemporaryFile() as other_file:
            other_file.truncate(offer.size)  # a plain file of the right size at another fd
            assert maps.open(replace(offer, fd=other_file.fileno()), 1000) is None
        assert maps.open(replace(offer, host="other-boot/other-host"), 1000) is None
        assert maps.open(replace(offer, nonce="0" * 32), 1000) is None
        assert maps.open(replace(offer, pid=os.getppid()), 1000) is None
        assert maps.open(offer, offer.size) is None  # the window would not fit
        assert maps.open(offer, 1000) is not None
        pool.give_back(segment, is_clean=False)  # retired: closed by the receiver
        assert maps.open(offer, 1000) is None
    finally:
        maps.close()


def test_staged_chunk_views_the_stage_in_wire_layout():
    stage = torch.arange(128, dtype=torch.float32).view(torch.uint8)  # 8 tokens of 16 floats
    chunk = staged_chunk(stage, 10, 12, 3, LAYOUT)  # tokens 2..4 of the window at 10
    assert chunk.shape == (2, 2, 3, 1, 4)
    assert chunk.flatten().tolist() == [float(x) for x in range(32, 80)]
    with pytest.raises(InvalidRequestError):
        staged_chunk(stage, 10, 14, 5, LAYOUT)  # past the stage's end (tokens 4..8 of 8)
    with pytest.raises(InvalidRequestError):
        staged_chunk(stage, 10, 9, 1, LAYOUT)  # before the window


def test_kv_addr_info_carries_the_shm_offer(pool):
    segment = pool.lease(1000)
    assert segment is not None
    info = KVAddrInfo("127.0.0.1:1", "r", "t" * 32, 0, 49, (1, 0, 49), LAYOUT, segment.offer(HOST))
    assert KVAddrInfo.decode(info.encode()) == info
    assert b'"shm"' not in replace(info, shm=None).encode()
