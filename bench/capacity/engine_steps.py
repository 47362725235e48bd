"""How the engines stepped during a cell: steps taken, their mean wall time and the tokens a
step sampled, from each shim's /metrics (`engine_step_seconds`, `generated_tokens`) at the
window's edges; the engine alone reports the same from its own counters.

Tokens a step is the batch the engine sampled on average: behind the relay, requests that
are between their last token and their next request's arrival are not in it. Loop ms a step
(the window over the steps) less step ms is the time the engine's loop spent outside its
steps (calls coming in, outputs going out, waiting for work); idle ms a step is the part of
it the loop waited with no work at all (the window less `engine_busy_seconds`; shims only)."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.capacity.router_metrics import fetch

_STEP = "microserving_shim_engine_step_seconds"
_TOKENS = "microserving_shim_generated_tokens"
_BUSY = "microserving_shim_engine_busy_seconds"

Counters = tuple[float, float, float, float]  # steps, seconds in steps, sampled tokens, busy seconds


def parse(text: str) -> Counters:
    steps = step_s = tokens = busy_s = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == _STEP + "_count":
                steps += sample.value
            elif sample.name == _STEP + "_sum":
                step_s += sample.value
            elif sample.name == _TOKENS + "_total":
                tokens += sample.value
            elif sample.name == _BUSY + "_total":
                busy_s += sample.value
    return steps, step_s, tokens, busy_s


def scrape(ports: dict[str, int]) -> dict[str, Counters]:
    return {name: parse(fetch(port)) for name, port in ports.items()}


def figures(steps: float, step_s: float, tokens: float, window_s: float,
            busy_s: float | None = None) -> dict[str, Any]:
    if steps <= 0:
        return {"steps": 0}
    out = {
        "steps": int(steps),
        "steps_per_s": steps / window_s,
        "tokens_per_step": tokens / steps,
        "step_ms": step_s / steps * 1e3,
        "loop_ms_per_step": window_s / steps * 1e3,
    }
    if busy_s is not None:
        out["idle_ms_per_step"] = max(0.0, window_s - busy_s) / steps * 1e3
    return out


def window(opened: dict[str, Counters], closed: dict[str, Counters], window_s: float) -> dict[str, Any]:
    """Per shim, the figures of the steps between the two scrapes."""
    out = {}
    for name, after in closed.items():
        before = opened.get(name, (0.0, 0.0, 0.0, 0.0))
        steps, step_s, tokens, busy_s = (a - b for a, b in zip(after, before, strict=True))
        out[name] = figures(steps, step_s, tokens, window_s, busy_s)
    return out
