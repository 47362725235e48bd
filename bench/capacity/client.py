"""The capacity benchmark's load: S closed-loop streams of /v1/completions through the
gateway, each request a fixed prompt of token ids with ignore_eos, streamed over SSE.

Kept lean on purpose (the client shares the machine with the stack): one json.loads per SSE
chunk and a few appends. Tokens are counted from text, one character per token: the
synthetic engine emits one printable byte token per token (engine_shim/backends/synthetic/tokens.py),
so counts stay exact when a hop merges several tokens into one chunk. Every token's arrival
falls inside or outside the measured window; only tokens inside it count.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass(frozen=True)
class LoadSpec:
    base_url: str  # ends in /v1
    model: str
    streams: int
    input_len: int
    output_len: int
    num_requests: int | None = None  # fixed count (every token counts), or
    warmup_s: float = 0.0  # a window [warmup_s, warmup_s + duration_s) of a timed run
    duration_s: float | None = None
    seed: int = 0
    timeout_s: float = 600.0
    # Count a request's tokens from its usage (a real engine's tokens need not be one
    # character each); needs a fixed request count, every request finishing.
    count_usage: bool = False
    # Merged into every request body (e.g. MLC's `debug_config` instead of `ignore_eos`).
    extra_body: dict[str, Any] = field(default_factory=dict)
    # Stream i sends its first request i * stagger_s after the start (0: all at once). With
    # equal output lengths, streams that start together end together and come back together:
    # the load runs in waves; staggered, arrivals spread as the engine alone's staggered run
    # spreads them (EngineAlone.run).
    stagger_s: float = 0.0


@dataclass
class StreamRecord:
    started_s: float
    ttft_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    num_tokens_in_window: int = 0
    num_chunks_in_window: int = 0  # content chunks: fewer than tokens where hops merge them
    completion_tokens: int | None = None  # from usage, for finished requests
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class LoadResult:
    records: list[StreamRecord]
    window_s: float  # the measured span


class Window:
    """The measured span, on the run's clock (seconds since the first request)."""

    def __init__(self, start_s: float, end_s: float) -> None:
        self.start_s, self.end_s = start_s, end_s

    def __contains__(self, t: float) -> bool:
        return self.start_s <= t < self.end_s


def prompt_ids(rng: random.Random, input_len: int) -> list[int]:
    """Lower-case letters and spaces as byte token ids: the tiny model's tokenizer."""
    alphabet = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz "]
    return [rng.choice(alphabet) for _ in range(input_len)]


async def stream_completion(
    session: aiohttp.ClientSession, spec: LoadSpec, ids: list[int], window: Window,
    origin_s: float, record: StreamRecord, url: str | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """One streamed completion into `record`: POST `url` (default: the spec's
    /v1/completions) with the workload's body plus `extra`."""
    payload: dict[str, Any] = {
        "model": spec.model, "prompt": ids, "max_tokens": spec.output_len,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, **spec.extra_body, **(extra or {}),
    }
    async with session.post(
        url or f"{spec.base_url}/completions", json=payload,
        timeout=aiohttp.ClientTimeout(total=spec.timeout_s),
    ) as response:
        if response.status != 200:
            record.error = f"http_{response.status}: {(await response.text())[:200]}"
            return
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                if spec.count_usage:
                    record.num_tokens_in_window = record.completion_tokens or 0
                return
            now_s = time.perf_counter() - origin_s
            _on_chunk(json.loads(data), record, now_s, window)
    record.error = record.error or "stream ended without [DONE]"


def _on_chunk(chunk: dict[str, Any], record: StreamRecord, now_s: float, window: Window) -> None:
    if "error" in chunk:
        record.error = json.dumps(chunk["error"])[:200]
        return
    usage = chunk.get("usage")
    if usage:
        record.completion_tokens = usage.get("completion_tokens")
    for choice in chunk.get("choices") or ():
        text = choice.get("text") or ""
        # A chunk carries tokens whenever it has text, or no finish: a token whose text is
        # not complete UTF-8 yet (common with a model's random weights) comes as text "".
        # Timing only text would time the detokenizer's holding back, not the relay.
        if text or not choice.get("finish_reason"):
            if record.ttft_s is None:
                record.ttft_s = now_s - record.started_s
            record.chunk_times_s.append(now_s)
            if now_s in window:
                record.num_tokens_in_window += len(text)
                record.num_chunks_in_window += 1
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]


# One request of a closed loop: (prompt ids, its record, the window, the clock's origin).
Send = Callable[[list[int], StreamRecord, Window, float], Awaitable[None]]


async def run_load(
    spec: LoadSpec, at_edge: Callable[[str], None] = lambda edge: None,
    starting: Callable[[], Awaitable[float]] | None = None,
) -> LoadResult:
    """Closed loop of /v1/completions streams over HTTP (see `drive`). `starting`, where
    given, is awaited once the client session exists and returns the clock's origin
    (perf_counter seconds, maybe ahead): how several client processes start together."""
    connector = aiohttp.TCPConnector(limit=spec.streams)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:

        async def send(ids: list[int], record: StreamRecord, window: Window, origin_s: float) -> None:
            try:
                await stream_completion(session, spec, ids, window, origin_s, record)
            except (TimeoutError, aiohttp.ClientError, ValueError) as error:
                record.error = f"{type(error).__name__}: {error}"[:200]

        origin_s = None if starting is None else await starting()
        return await drive(spec, send, at_edge, origin_s)


async def drive(spec: LoadSpec, send: Send, at_edge: Callable[[str], None],
                origin_s: float | None = None) -> LoadResult:
    """Closed loop: `streams` workers, each sending its next request when one ends, from
    `origin_s` (perf_counter seconds; default now). `at_edge("open")` and `at_edge("close")`
    run at the measured window's edges (the caller reads CPU counters there). `send` records
    its own failures."""
    rng = random.Random(spec.seed)
    is_timed = spec.duration_s is not None
    window = (
        Window(spec.warmup_s, spec.warmup_s + (spec.duration_s or 0.0)) if is_timed
        else Window(0.0, float("inf"))
    )
    records: list[StreamRecord] = []
    remaining = [spec.num_requests or 0]
    origin_s = time.perf_counter() if origin_s is None else origin_s

    def has_next(now_s: float) -> bool:
        if is_timed:
            return now_s < window.end_s
        remaining[0] -= 1
        return remaining[0] >= 0

    async def worker(index: int) -> None:
        if spec.stagger_s:
            await sleep_until(index * spec.stagger_s)
        while has_next(time.perf_counter() - origin_s):
            record = StreamRecord(started_s=time.perf_counter() - origin_s)
            records.append(record)
            await send(prompt_ids(rng, spec.input_len), record, window, origin_s)

    async def sleep_until(t_s: float) -> None:
        await asyncio.sleep(max(0.0, t_s - (time.perf_counter() - origin_s)))

    await sleep_until(0.0)  # an origin ahead: every client process starts together
    if not is_timed:
        at_edge("open")
    workers = [asyncio.create_task(worker(index)) for index in range(spec.streams)]
    if is_timed:
        await sleep_until(window.start_s)
        at_edge("open")
        await sleep_until(window.end_s)
        at_edge("close")
        for task in workers:  # the window is over: streams still open are cut off
            task.cancel()
    await asyncio.gather(*workers, return_exceptions=is_timed)
    ended_s = time.perf_counter() - origin_s
    if not is_timed:
        at_edge("close")
    span_s = (spec.duration_s or 0.0) if is_timed else ended_s
    return LoadResult(records, span_s)
