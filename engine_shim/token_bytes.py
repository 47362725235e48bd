"""Exact bytes of every token id, and back. MLC's HTTP responses carry text, not token ids;
with logprobs each token also carries its `bytes`, which map back to the id exactly. The
MLC-wire-compatible server fills `bytes` from this table and the MLC backend reads it."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from microserving.tokenizer import PRESET_NAMES, build_byte_level_backend

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character table (used by ByteLevel models)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars = list(kept)
    extra = 0
    for byte in range(256):
        if byte not in kept:
            kept.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(kept, chars, strict=True)}


def _load_backend(model: str) -> HFTokenizer:
    if model in PRESET_NAMES:
        return build_byte_level_backend()
    return HFTokenizer.from_file(str(Path(model) / "tokenizer.json"))


def _token_bytes(backend: HFTokenizer, token: str, is_byte_level: bool) -> bytes:
    if is_byte_level:
        table = _unicode_to_byte()
        if all(ch in table for ch in token):
            return bytes(table[ch] for ch in token)
    match = _BYTE_FALLBACK.match(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


class TokenBytes:
    """id <-> raw bytes for one model's vocabulary."""

    def __init__(self, model: str) -> None:
        backend = _load_backend(model)
        is_byte_level = "ByteLevel" in type(backend.decoder).__name__ or (
            backend.decoder is not None and "ByteLevel" in str(backend.decoder)
        )
        special = {t.content for t in backend.get_added_tokens_decoder().values()}
        self._bytes: list[bytes] = []
        self._ids: dict[bytes, int] = {}
        for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
            token = backend.id_to_token(token_id) or ""
            raw = (
                token.encode() if token in special else _token_bytes(backend, token, is_byte_level)
            )
            self._bytes.append(raw)
            self._ids.setdefault(raw, token_id)

    def to_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def to_id(self, raw: bytes) -> int | None:
        return self._ids.get(raw)
