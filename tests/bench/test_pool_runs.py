"""bench.pool_runs drives the real engine as a decode engine until its KV pool has recycled:
every reservation is counted, the recycled ones are told apart, and on a recycled pool a
reservation still gets (nearly) one run of slots (block_manager's runs; strict LRU gave most
of them one run a page)."""

from __future__ import annotations

import statistics

import pytest

from bench.pool_runs import reservation_runs

pytestmark = pytest.mark.unit


def test_reservations_on_a_recycled_pool_stay_in_few_runs() -> None:
    runs, recycled_from = reservation_runs(streams=6, num_requests=60, num_pages=160,
                                           prompt_len=128, output_len=48)
    assert len(runs) == 60
    assert 0 < recycled_from < 40  # the pool recycled early in the run
    assert runs[0] == 1  # a fresh pool: one run
    recycled = runs[recycled_from:]
    assert statistics.median(recycled) == 1 and max(recycled) <= 3, recycled
