"""Exact bytes of every token id of a model, and back. MLC's HTTP responses carry text, not
token ids; with logprobs each token also carries its bytes (or its `bytes:\\xNN` text), which
map back to the id exactly. The MLC-wire-compatible server fills them from this table and the
MLC backend reads them."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from microserving.token_bytes import token_bytes_table
from microserving.tokenizer import PRESET_NAMES, build_byte_level_backend


def _load_backend(model: str) -> HFTokenizer:
    if model in PRESET_NAMES:
        return build_byte_level_backend()
    return HFTokenizer.from_file(str(Path(model) / "tokenizer.json"))


class TokenBytes:
    """id <-> raw bytes for one model's vocabulary."""

    def __init__(self, model: str) -> None:
        self._bytes = token_bytes_table(_load_backend(model))
        self._ids: dict[bytes, int] = {}
        for token_id, raw in enumerate(self._bytes):
            self._ids.setdefault(raw, token_id)

    def to_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def to_id(self, raw: bytes) -> int | None:
        return self._ids.get(raw)
