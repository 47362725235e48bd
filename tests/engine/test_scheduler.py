"""Continuous batching on its own (plain Python, no model): what one schedule() computes, the
prefill budget, admission limits, prefix-cache hits, which sequence is preempted when pages
run out and what happens to it, and a sequence the whole pool cannot hold."""

from __future__ import annotations

import pytest

from engine_shim.engine.block_manager import BlockManager
from engine_shim.engine.scheduler import Scheduler, SchedulerOutput
from engine_shim.engine.sequence import SeqKind, SeqStatus, Sequence

pytestmark = pytest.mark.unit

PAGE_SIZE = 4


def make_scheduler(
    num_pages: int, max_num_seqs: int = 8, prefill_chunk_size: int = 64, prefix_cache: bool = False
) -> Scheduler:
    return Scheduler(BlockManager(num_pages, PAGE_SIZE, prefix_cache), max_num_seqs, prefill_chunk_size)


def new_seq(seq_id: int, num_prompt_tokens: int, kind: SeqKind = SeqKind.GENERATE,
            first_token: int = 0) -> Sequence:
    tokens = list(range(first_token, first_token + num_prompt_tokens))
    return Sequence(seq_id, f"r{seq_id}", tokens, num_prompt_tokens, kind)


def computed(scheduler: Scheduler, out: SchedulerOutput) -> dict[int, int]:
    """Apply a step as the engine would (each scheduled sequence computed its tokens; one
    sampled token appended to a generate sequence that caught up) and return seq id ->
    number of tokens scheduled."""
    scheduled = {item.seq.seq_id: item.num_tokens for item in out.scheduled}
    for item in out.scheduled:
        scheduler.on_computed(item)
        if item.seq.kind is SeqKind.GENERATE and item.seq.num_pending_tokens == 0:
            item.seq.token_ids.append(7)
    return scheduled


def test_a_prompt_is_prefilled_in_one_step_then_decodes_one_token_per_step() -> None:
    scheduler = make_scheduler(num_pages=8)
    seq = new_seq(1, 10)
    scheduler.add(seq)
    assert computed(scheduler, scheduler.schedule()) == {1: 10}
    assert seq.status is SeqStatus.RUNNING and len(seq.block_table) == 3
    assert computed(scheduler, scheduler.schedule()) == {1: 1}
    assert seq.num_computed_tokens == 11 and len(seq.block_table) == 3
    computed(scheduler, scheduler.schedule())  # position 11: the third page's last slot
    assert len(seq.block_table) == 3
    computed(scheduler, scheduler.schedule())
    assert len(seq.block_table) == 4  # position 12 needed a fourth page


def test_prompts_share_the_prefill_budget_and_a_long_one_is_chunked() -> None:
    scheduler = make_scheduler(num_pages=32, prefill_chunk_size=16)
    first, second = new_seq(1, 12), new_seq(2, 12, first_token=50)
    scheduler.add(first)
    scheduler.add(second)
    assert computed(scheduler, scheduler.schedule()) == {1: 12, 2: 4}
    # The first decodes (outside the budget); the second's prompt continues.
    assert computed(scheduler, scheduler.schedule()) == {1: 1, 2: 8}


def test_no_more_than_max_num_seqs_run_at_once() -> None:
    scheduler = make_scheduler(num_pages=32, max_num_seqs=2)
    for seq_id in (1, 2, 3):
        scheduler.add(new_seq(seq_id, 4, first_token=10 * seq_id))
    assert set(computed(scheduler, scheduler.schedule())) == {1, 2}
    assert [s.seq_id for s in scheduler.waiting] == [3]


def test_a_waiting_prompt_stays_queued_with_no_pages_held_until_pages_free_up() -> None:
    scheduler = make_scheduler(num_pages=3, prefix_cache=True)
    running = new_seq(1, 8)
    scheduler.add(running)
    computed(scheduler, scheduler.schedule())
    waiting = new_seq(2, 8, first_token=100)
    scheduler.add(waiting)
    assert computed(scheduler, scheduler.schedule()) == {1: 1}  # 1 free page: not enough for 8
    assert waiting.status is SeqStatus.WAITING and waiting.block_table == []
    scheduler.remove(running)
    scheduler.release(running)
    assert computed(scheduler, scheduler.schedule()) == {2: 8}


def run_and_finish(scheduler: Scheduler, seq: Sequence) -> None:
    """Prefill `seq` alone, then end it: its computed full pages go to the prefix cache."""
    scheduler.add(seq)
    computed(scheduler, scheduler.schedule())
    scheduler.remove(seq)
    scheduler.release(seq)


def test_a_cached_prefix_is_not_computed_again() -> None:
    scheduler = make_scheduler(num_pages=16, prefix_cache=True)
    run_and_finish(scheduler, new_seq(1, 10))  # 2 full pages cached
    again = new_seq(2, 10)
    scheduler.add(again)
    assert computed(scheduler, scheduler.schedule()) == {2: 2}  # 8 of 10 from the cache
    assert again.num_cached_tokens == 8


def test_a_send_job_whose_window_is_all_cached_is_ready_without_compute() -> None:
    scheduler = make_scheduler(num_pages=16, prefix_cache=True)
    run_and_finish(scheduler, new_seq(1, 8))
    send = new_seq(2, 8, kind=SeqKind.SEND)
    scheduler.add(send)
    out = scheduler.schedule()
    assert out.scheduled == [] and out.ready_sends == [send]
    assert send.status is SeqStatus.PARKED and len(send.block_table) == 2


def test_when_pages_run_out_the_newest_running_sequence_is_preempted_and_recomputed() -> None:
    scheduler = make_scheduler(num_pages=4)
    older, newer = new_seq(1, 4), new_seq(2, 4, first_token=20)
    scheduler.add(older)
    scheduler.add(newer)
    computed(scheduler, scheduler.schedule())  # one page each, both full
    scheduler.block_manager.allocate(scheduler.block_manager.num_free_pages)  # pool now full
    out = scheduler.schedule()
    assert computed(scheduler, out) == {1: 1}
    assert scheduler.num_preemptions == 1 and out.preempted_aborted == []
    assert newer.status is SeqStatus.WAITING and scheduler.waiting[0] is newer
    assert newer.num_computed_tokens == 0 and newer.block_table == []  # recomputed later


def test_a_preempted_disaggregated_sequence_is_aborted_not_recomputed() -> None:
    scheduler = make_scheduler(num_pages=4)
    local, pd = new_seq(1, 4), new_seq(2, 4, first_token=20)
    pd.is_disaggregated = True  # its KV came from another engine
    scheduler.add(local)
    scheduler.add(pd)
    computed(scheduler, scheduler.schedule())
    scheduler.block_manager.allocate(scheduler.block_manager.num_free_pages)
    out = scheduler.schedule()
    assert out.preempted_aborted == [pd]
    assert pd.status is SeqStatus.FINISHED and pd.block_table == []
    assert pd not in scheduler.waiting and pd not in scheduler.running


def test_a_sequence_already_scheduled_this_step_is_never_the_victim() -> None:
    scheduler = make_scheduler(num_pages=2)
    roomy, full = new_seq(1, 2), new_seq(2, 4, first_token=20)
    scheduler.add(roomy)
    scheduler.add(full)
    computed(scheduler, scheduler.schedule())  # roomy: 3 of 4 slots; full: 4 of 4; pool used
    # roomy decodes in its own page and is scheduled first; full needs a page and the only
    # other running sequence is already in this step, so full itself steps back.
    out = scheduler.schedule()
    assert computed(scheduler, out) == {1: 1}
    assert roomy.status is SeqStatus.RUNNING and full.status is SeqStatus.WAITING
    assert scheduler.num_preemptions == 1 and full.block_table == []


def test_a_sequence_the_whole_pool_cannot_hold_is_reported_out_of_pages() -> None:
    scheduler = make_scheduler(num_pages=2)
    seq = new_seq(1, 8)
    scheduler.add(seq)
    computed(scheduler, scheduler.schedule())  # 8 tokens: both pages
    out = scheduler.schedule()  # the next position needs a third page
    assert out.out_of_pages == [seq] and out.scheduled == []
    assert seq not in scheduler.running
    assert scheduler.num_preemptions == 0


@pytest.mark.parametrize("is_disaggregated", [False, True])
def test_a_sequence_the_pool_could_hold_waits_while_pages_are_held_outside_the_running_ones(
    is_disaggregated: bool,
) -> None:
    """Pages a reservation (or a send job) holds are not the sequence's limit: it steps back
    (recomputed later, or preempted for the router to resume), never ends with "length"."""
    scheduler = make_scheduler(num_pages=4)
    seq = new_seq(1, 4)
    seq.is_disaggregated = is_disaggregated
    scheduler.add(seq)
    computed(scheduler, scheduler.schedule())  # one full page
    scheduler.block_manager.allocate(scheduler.block_manager.num_free_pages)  # a reservation's
    out = scheduler.schedule()  # position 5 needs a second page of the four
    assert out.out_of_pages == [] and out.scheduled == []
    assert scheduler.num_preemptions == 1 and seq.block_table == []
    if is_disaggregated:
        assert out.preempted_aborted == [seq]
    else:
        assert scheduler.waiting[0] is seq and seq.status is SeqStatus.WAITING


def test_a_queued_sequence_holding_a_reservation_steps_back_when_only_queued_ones_hold_pages() -> None:
    """Two sequences that came with KV (reservations) hold the whole pool between them; the
    first in line needs one more page for its first token and nothing runs: it is preempted
    so the other one can run, instead of both waiting for ever."""
    scheduler = make_scheduler(num_pages=4)
    first, second = new_seq(1, 8), new_seq(2, 8, first_token=20)
    for seq in (first, second):
        seq.is_disaggregated = True
        seq.block_table = scheduler.block_manager.allocate(2)  # its reservation's pages
        seq.num_computed_tokens = 8  # the KV another engine sent
        seq.token_ids.append(7)  # the token to decode next needs a third page
        scheduler.add(seq)
    out = scheduler.schedule()
    assert out.preempted_aborted == [first] and first.block_table == []
    out = scheduler.schedule()
    assert computed(scheduler, out) == {2: 1} and scheduler.running == [second]


def test_the_sequence_that_needs_a_page_waits_when_only_scheduled_ones_could_give_one() -> None:
    scheduler = make_scheduler(num_pages=2)
    first, second = new_seq(1, 4), new_seq(2, 4, first_token=20)
    scheduler.add(first)
    scheduler.add(second)
    computed(scheduler, scheduler.schedule())
    # Both need a page for position 5; none is free. first preempts second (the newest);
    # first's new page comes from second's.
    out = scheduler.schedule()
    assert computed(scheduler, out) == {1: 1}
    assert scheduler.running == [first] and scheduler.waiting[0] is second
