"""Server-sent events as MLC streams them: `data: {json}` lines, ended by `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

DONE = "[DONE]"


async def sse_json(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON payload of every `data:` event until [DONE] (or the end of the stream)."""
    async for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, other fields
        payload = line[len("data:") :].strip()
        if payload == DONE:
            return
        if payload:
            yield json.loads(payload)
