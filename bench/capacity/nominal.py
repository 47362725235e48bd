"""What the synthetic engines' schedule allows for a closed-loop workload, so the client's
rate can be read as a fraction of it.

Round-robin (one engine): each of S streams needs `output_len` steps of batch S per request,
and its prompt adds input_len / prefill rate to one of them, so a cycle in which every stream
finishes one request lasts output_len * step(S) + S * input_len / rate.
Disagg (1P:1D): the decode engine runs output_len steps of batch S per request (its one
prompt token is negligible); each request also spends its prefill phase on the prefill
engine, a step of batch 1 plus (input_len - 1) / rate.
The first token, at best: the step that ends the prompt (round-robin), or the prefill
engine's step then the decode engine's first step (disagg)."""

from __future__ import annotations

from dataclasses import dataclass

from engine_shim.backends.synthetic.profile import StepProfile


@dataclass(frozen=True)
class Nominal:
    tok_s: float  # closed-loop tokens/s the schedule allows, prompts included
    decode_tok_s: float  # streams / step(streams): decode alone
    ttft_s: float  # the schedule's own time to the first token


def nominal(
    pattern: str, streams: int, profile: StepProfile, input_len: int, output_len: int
) -> Nominal:
    step_s = profile.decode_step_s(streams)
    decode_tok_s = streams / step_s
    if pattern == "round-robin":
        cycle_s = output_len * step_s + streams * input_len / profile.prefill_tok_s
        ttft_s = profile.step_s(streams, input_len)
    elif pattern == "disagg":
        prefill_phase_s = profile.step_s(1, input_len - 1)
        cycle_s = prefill_phase_s + output_len * step_s
        ttft_s = prefill_phase_s + profile.step_s(streams, 1)
    else:
        raise ValueError(f"no schedule model for pattern {pattern!r}")
    return Nominal(streams * output_len / cycle_s, decode_tok_s, ttft_s)
