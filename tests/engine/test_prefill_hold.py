"""The prefill hold (EngineConfig.prefill_hold_ms): while sequences decode, a new prompt waits up
to the hold for others to share its prefill step; never when nothing decodes, when a full chunk
of prompt tokens waits, or for a sequence whose KV came from elsewhere. Held or not, greedy
outputs are the same tokens."""

from __future__ import annotations

import pytest
from engine_test_utils import GREEDY, random_prompt

from engine_shim.engine.block_manager import BlockManager
from engine_shim.engine.config import EngineConfig
from engine_shim.engine.llm_engine import LLMEngine
from engine_shim.engine.scheduler import Scheduler
from engine_shim.engine.sequence import Sequence


class _Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _scheduler(clock: _Clock, hold_s: float = 0.010, chunk: int = 64) -> Scheduler:
    return Scheduler(BlockManager(64, 16, False), max_num_seqs=8, prefill_chunk_size=chunk,
                     prefill_hold_s=hold_s, clock=clock)


def _seq(seq_id: int, num_prompt_tokens: int) -> Sequence:
    ids = list(range(10, 10 + num_prompt_tokens))
    return Sequence(seq_id, f"r{seq_id}", ids, num_prompt_tokens)


def _decoding(scheduler: Scheduler, seq: Sequence) -> None:
    """Admit and prefill `seq`, then give it a sampled token: it decodes from here."""
    out = scheduler.schedule()
    for item in out.scheduled:
        scheduler.on_computed(item)
    seq.token_ids.append(7)
    assert seq.num_pending_tokens == 1


def _one_decoding(clock: _Clock, **options: float) -> tuple[Scheduler, Sequence]:
    """A scheduler with one sequence decoding and one new prompt (r2) waiting."""
    scheduler = _scheduler(clock, **options)  # type: ignore[arg-type]
    first = _seq(1, 20)
    scheduler.add(first)
    _decoding(scheduler, first)
    scheduler.add(_seq(2, 20))
    return scheduler, first


def _admitted(scheduler: Scheduler) -> list[str]:
    out = scheduler.schedule()
    for item in out.scheduled:
        scheduler.on_computed(item)
    return [item.seq.request_id for item in out.scheduled if item.num_tokens > 1]


def test_a_prompt_waits_while_others_decode_until_the_hold_ends() -> None:
    clock = _Clock()
    scheduler, first = _one_decoding(clock)
    clock.now_s += 0.004
    assert _admitted(scheduler) == []  # held: the step stays pure decode
    first.token_ids.append(7)
    scheduler.add(_seq(3, 20))
    clock.now_s += 0.007  # 11 ms after the oldest arrived
    assert _admitted(scheduler) == ["r2", "r3"]  # both in one prefill step


def test_an_idle_engine_admits_at_once() -> None:
    scheduler = _scheduler(_Clock())
    scheduler.add(_seq(1, 20))
    assert _admitted(scheduler) == ["r1"]


def test_a_full_chunk_of_waiting_prompt_tokens_is_admitted_at_once() -> None:
    scheduler, first = _one_decoding(_Clock(), chunk=32)
    assert _admitted(scheduler) == []
    first.token_ids.append(7)
    scheduler.add(_seq(3, 20))  # 40 tokens wait: more than the step's 32
    assert _admitted(scheduler) == ["r2", "r3"]  # r3's first 12 tokens fit this step


def test_without_a_hold_a_prompt_is_admitted_beside_decodes() -> None:
    scheduler, _ = _one_decoding(_Clock(), hold_s=0.0)
    assert _admitted(scheduler) == ["r2"]


@pytest.mark.integration
def test_held_prompts_get_the_same_greedy_tokens() -> None:
    """Arrivals one step apart, with a long hold and without: token for token the same."""

    def run(hold_ms: float) -> dict[str, list[int]]:
        engine = LLMEngine(EngineConfig(num_pages=128, prefill_hold_ms=hold_ms))
        tokens: dict[str, list[int]] = {}
        arrivals = [(f"req-{i}", random_prompt(i, 30 + 7 * i)) for i in range(4)]
        while arrivals or engine.has_work:
            if arrivals:
                request_id, ids = arrivals.pop(0)
                engine.start_generate(request_id, ids, 0, GREEDY)
                tokens[request_id] = []
            for event in engine.step():
                for delta in getattr(event, "deltas", ()):
                    tokens[event.request_id].extend(delta.token_ids)
        return tokens

    held, plain = run(500.0), run(0.0)
    assert held == plain
    assert all(len(ids) == GREEDY.max_tokens for ids in held.values())
