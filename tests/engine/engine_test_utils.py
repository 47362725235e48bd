"""Helpers shared by the engine tests (imported by name: tests/ is not a package)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from engine_shim.engine.api import GenerateOutput, SamplingParams
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
