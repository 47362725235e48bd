"""A core in its own process sends its outputs as plain tuples (api.PackedOutput): unpacked,
they are exactly the GenerateOutputs the same engine builds otherwise, for every kind of
output (token ids, held-back text at a stop string, logprobs, n > 1, finish reasons, usage,
an abort)."""

from __future__ import annotations

from typing import Any

from engine_shim.engine.api import GenerateOutput, SamplingParams, unpack_output
from engine_shim.engine.config import EngineConfig
from engine_shim.engine.llm_engine import LLMEngine

REQUESTS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    "stop": SamplingParams(temperature=0.0, max_tokens=12, stop=("zz", "ab"), ignore_eos=True),
    "logprobs": SamplingParams(temperature=0.0, max_tokens=6, logprobs=True, top_logprobs=3, ignore_eos=True),
    "n2": SamplingParams(temperature=0.9, n=2, seed=5, max_tokens=8, ignore_eos=True),
    "aborted": SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
}


def _events(packs: bool) -> list[Any]:
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", num_pages=128))
    engine.packs_outputs = packs
    for i, (request_id, sampling) in enumerate(REQUESTS.items()):
        engine.add_request(request_id, [(11 * i + j) % 200 + 1 for j in range(7 + 3 * i)], sampling)
    events: list[Any] = []
    steps = 0
    while engine.has_work:
        events += engine.step()
        steps += 1
        if steps == 3:
            engine.abort("aborted")
    return events


def test_packed_outputs_unpack_to_the_outputs_the_engine_builds_otherwise() -> None:
    built, packed = _events(packs=False), _events(packs=True)
    assert all(isinstance(e, GenerateOutput) for e in built)
    assert all(type(e) is tuple for e in packed)
    unpacked = [unpack_output(e) for e in packed]
    assert unpacked == built
    finished = {o.request_id for o in unpacked if o.is_finished}
    assert finished == set(REQUESTS)
    assert any(d.logprobs for o in unpacked for d in o.deltas)
    assert {d.index for o in unpacked if o.request_id == "n2" for d in o.deltas} == {0, 1}
