"""Server-sent events framing as OpenAI streams them: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

DONE_EVENT = b"data: [DONE]\n\n"

# JSON may carry these raw, but str.splitlines() (and clients built on it, e.g. httpx's
# iter_lines) ends a line at each of them and would cut an event in two: send them escaped.
_LINE_SEPARATORS = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def _escape_line_separators(json_text: str) -> str:
    if not any(c in json_text for c in _LINE_SEPARATORS):
        return json_text
    for raw, escaped in _LINE_SEPARATORS.items():
        json_text = json_text.replace(raw, escaped)
    return json_text


def encode_event(payload: BaseModel | dict[str, Any]) -> bytes:
    """One SSE event carrying a JSON object (no spaces: the payload is on one line)."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json()
    else:
        text = json.dumps(payload, separators=(",", ":"))
    return b"data: " + _escape_line_separators(text).encode() + b"\n\n"


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


class ChunkTemplate:
    """Fast framing of the one streamed chunk shape that dominates a stream: one choice, no
    logprobs. The constant parts are rendered once by pydantic from `prototype` (a chunk whose
    choice text and finish_reason are the markers below); each event then splices in the JSON
    of the index, text and finish reason. Equal to `encode_event(model)` (tested)."""

    INDEX_MARKER = 987654321
    TEXT_MARKER = "\x00text\x00"

    def __init__(self, prototype: BaseModel) -> None:
        rendered = encode_event(prototype)
        index_json = str(self.INDEX_MARKER).encode()
        text_json = json.dumps(self.TEXT_MARKER, separators=(",", ":")).encode()
        head, rest = rendered.split(index_json)
        middle, tail = rest.split(text_json)
        self._head, self._middle = head, middle
        reason_key = b'"finish_reason":null'
        reason_at = tail.index(reason_key) + len(reason_key) - len(b"null")
        self._before_reason, self._after_reason = tail[:reason_at], tail[reason_at + 4:]

    def encode(self, index: int, text: str, finish_reason: str | None) -> bytes:
        reason = b"null" if finish_reason is None else b'"' + finish_reason.encode() + b'"'
        return b"".join((self._head, str(index).encode(), self._middle,
                         _escape_line_separators(
                             json.dumps(text, ensure_ascii=False, separators=(",", ":"))).encode(),
                         self._before_reason, reason, self._after_reason))
