"""Helpers shared by the engine tests (imported by name: tests/ is not a package)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from engine_shim.engine.api import GenerateOutput, KVChunk, SamplingParams
from engine_shim.engine.disaggregation import FirstTokens
from engine_shim.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def tokens_of(outputs: list[GenerateOutput], index: int = 0) -> list[int]:
    return [t for o in outputs for d in o.deltas if d.index == index for t in d.token_ids]


def finish_of(outputs: list[GenerateOutput], index: int = 0) -> object:
    reasons = [d.finish_reason for o in outputs for d in o.deltas if d.index == index]
    return next((r for r in reasons if r is not None), None)


def generate_alone(engine: LLMEngine, request_id: str, ids: list[int], sampling: SamplingParams) -> list[int]:
    engine.add_request(request_id, ids, sampling)
    return tokens_of(engine.run_until_done()[request_id])


def random_prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def poll_sides(*sides: Any, until: Callable[[list[tuple]], bool], within_s: float = 20.0) -> list[tuple]:
    """Every NIXL side's events (nixl_core.NixlSide.poll), polled together (UCX over TCP
    moves a write only while both agents progress), until `until(events)`."""
    deadline = time.monotonic() + within_s
    events: list[tuple] = []
    while not until(events):
        assert time.monotonic() < deadline, f"not there in time; saw {events}"
        for side in sides:
            events += side.poll()
    return events


def sample_first_and_export(
    prefill: LLMEngine, request_id: str, ids: list[int], sampling: SamplingParams,
    begin: int = 0, end: int | None = None,
) -> tuple[FirstTokens, list[KVChunk]]:
    """A sending engine's remote_send of [begin, end) (default: the whole prompt) that samples
    the first tokens (`first`): stepped until they are drawn and the KV is computed, the
    window exported, the send finished."""
    prefill.remote_send(request_id, ids, begin, len(ids) if end is None else end, first=sampling)
    first: FirstTokens | None = None
    while first is None or not prefill.disaggregation.sends[request_id].is_ready:
        first = next((e for e in prefill.step() if isinstance(e, FirstTokens)), first)
    chunks = [prefill.export_kv(request_id, b, n) for b, n in prefill.export_windows(request_id)]
    prefill.finish_remote_send(request_id)
    return first, chunks
