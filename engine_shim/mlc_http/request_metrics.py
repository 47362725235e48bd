"""`usage.extra` as MLC's engines fill it (RequestMetrics in MLC's cpp/serve/metrics.cc):
token counts by phase and the request's timings, measured here from arrival to last output."""

from __future__ import annotations

import time
from typing import Any

from engine_shim.engine.api import Usage


class RequestMetrics:
    def __init__(self) -> None:
        self.arrived_s = time.perf_counter()
        self.first_token_s: float | None = None

    def saw_tokens(self) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter()

    def extra(self, usage: Usage) -> dict[str, Any]:
        finished_s = time.perf_counter()
        first_s = self.first_token_s or finished_s
        ttft_s = first_s - self.arrived_s
        total_s = finished_s - self.arrived_s
        # Prompt tokens whose KV arrived (prefix cache or remote_send) were not prefilled here;
        # the first output token comes out of prefill, the others out of decode steps.
        prefill_tokens = usage.prompt_tokens - usage.cached_tokens - usage.transferred_tokens
        decode_tokens = max(usage.completion_tokens - 1, 0)
        extra: dict[str, Any] = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "prefill_tokens": prefill_tokens,
            "decode_tokens": decode_tokens,
            "jump_forward_tokens": 0,  # no grammar, so no jump-forward decoding
        }
        if prefill_tokens and ttft_s > 0:
            extra["prefill_tokens_per_s"] = prefill_tokens / ttft_s
        if decode_tokens and total_s > ttft_s:
            extra["decode_tokens_per_s"] = decode_tokens / (total_s - ttft_s)
        extra["end_to_end_latency_s"] = total_s
        extra["ttft_s"] = ttft_s
        extra["inter_token_latency_s"] = total_s / max(usage.completion_tokens, 1)
        return extra
