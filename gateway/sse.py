"""Server-sent events framing as OpenAI streams them: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

DONE_EVENT = b"data: [DONE]\n\n"


def encode_event(payload: BaseModel | dict[str, Any]) -> bytes:
    """One SSE event carrying a JSON object (no spaces: the payload is on one line)."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json()
    else:
        text = json.dumps(payload, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


async def frame(events: AsyncIterator[BaseModel | dict[str, Any]]) -> AsyncIterator[bytes]:
    """Frames every payload as an event and closes the stream with [DONE]."""
    async for payload in events:
        yield encode_event(payload)
    yield DONE_EVENT


def parse_events(body: bytes) -> list[Any]:
    """Client side (tests, bench): the JSON payloads of an SSE body, "[DONE]" kept as a str."""
    payloads: list[Any] = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        if not block.startswith("data: "):
            raise ValueError(f"not an SSE data event: {block!r}")
        data = block[len("data: "):]
        payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads
