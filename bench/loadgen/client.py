"""One streaming request against an OpenAI-compatible server, timed chunk by chunk.

TTFT is the time to the first chunk that carries output text; inter-token latencies are the
gaps between later content chunks (a server that coalesces several tokens per chunk shows
fewer, longer gaps); TPOT is (JCT - TTFT) / (output tokens - 1) with the server's reported
completion_tokens when it sends usage. Failures are recorded, never raised.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.loadgen.workload import RequestSpec


@dataclass(frozen=True)
class RequestOptions:
    """How every request of a run is sent."""

    base_url: str  # ends in /v1
    model: str
    endpoint: str = "completions"  # completions | chat
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = None
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{self.base_url.rstrip('/')}/{path}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds, relative to the run's start."""

    index: int
    input_len: int
    max_tokens: int
    start_s: float = 0.0
    end_s: float = 0.0
    ttft_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    output_text_chars: int = 0
    error: str | None = None  # error kind, e.g. "http_429", "ClientConnectorError"
    error_detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def jct_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def output_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.chunk_times_s)

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.jct_s - self.ttft_s) / (self.output_tokens - 1)


def build_payload(spec: RequestSpec, options: RequestOptions) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": options.model,
        "max_tokens": spec.max_tokens,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.endpoint == "chat":
        payload["messages"] = spec.messages or [{"role": "user", "content": _as_text(spec)}]
    else:
        payload["prompt"] = spec.prompt if spec.prompt is not None else _messages_text(spec)
    if options.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(options.extra_body)
    return payload


def _as_text(spec: RequestSpec) -> str:
    if isinstance(spec.prompt, list):
        raise ValueError("token-id prompts need the completions endpoint")
    return spec.prompt or ""


def _messages_text(spec: RequestSpec) -> str:
    return "\n".join(m.get("content", "") for m in spec.messages or [])


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return str((choice.get("delta") or {}).get("content") or "")
    return str(choice.get("text") or "")


def _carries_a_token(chunk: dict[str, Any]) -> bool:
    """A streamed chunk that stands for generated tokens even though its text is empty (a
    token that decodes to nothing, or half a UTF-8 character): a choice still running whose
    `text` / `delta.content` field is present. The chat role chunk and finish-only chunks
    don't count."""
    for choice in chunk.get("choices") or []:
        if choice.get("finish_reason") is not None:
            continue
        delta = choice.get("delta")
        if delta is None and "text" in choice:
            return True
        if delta is not None and "content" in delta and "role" not in delta:
            return True
    return False


async def send_request(
    session: aiohttp.ClientSession,
    spec: RequestSpec,
    options: RequestOptions,
    record: RequestRecord,
    clock_origin_s: float,
) -> RequestRecord:
    """Send one streaming request and fill `record`; never raises (except cancellation)."""
    record.start_s = time.perf_counter() - clock_origin_s
    try:
        await _stream(session, spec, options, record, clock_origin_s)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # every failure is a measured outcome of the run
        record.error = record.error or type(exc).__name__
        record.error_detail = str(exc)[:300]
    record.end_s = time.perf_counter() - clock_origin_s
    return record


async def _stream(
    session: aiohttp.ClientSession,
    spec: RequestSpec,
    options: RequestOptions,
    record: RequestRecord,
    origin_s: float,
) -> None:
    payload = build_payload(spec, options)
    timeout = aiohttp.ClientTimeout(total=options.timeout_s)
    async with session.post(
        options.url, json=payload, headers=options.headers, timeout=timeout
    ) as response:
        if response.status != 200:
            record.error = f"http_{response.status}"
            record.error_detail = (await response.text())[:300]
            return
        is_done = False
        async for raw_line in response.content:
            line = raw_line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                is_done = True
                break
            _on_chunk(json.loads(data), record, time.perf_counter() - origin_s)
    if not is_done and record.error is None:
        record.error = "incomplete_stream"
        record.error_detail = "the stream ended without data: [DONE]"


def _on_chunk(chunk: dict[str, Any], record: RequestRecord, now_s: float) -> None:
    if "error" in chunk:
        record.error = "stream_error"
        record.error_detail = json.dumps(chunk["error"])[:300]
        return
    usage = chunk.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")
    text = _chunk_text(chunk)
    if not text and not _carries_a_token(chunk):
        return
    if record.ttft_s is None:
        record.ttft_s = now_s - record.start_s
    record.chunk_times_s.append(now_s)
    record.output_text_chars += len(text)
