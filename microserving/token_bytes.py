"""The raw bytes of every token of a vocabulary, and how a token is shown as text.

A token can hold part of a UTF-8 character (byte-level BPE, `<0xNN>` byte fallback); its
text then cannot carry it, so logprobs carry the raw bytes beside the text, and text formats
without a bytes field show such a token as `bytes:\\xNN...` (OpenAI's convention), which keeps
two different partial tokens from collapsing into one U+FFFD key."""

from __future__ import annotations

import codecs
import re
from functools import cache

from tokenizers import Tokenizer as HFTokenizer

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_BYTES_PREFIX = "bytes:"


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


def _is_byte_level(backend: HFTokenizer) -> bool:
    decoder = backend.decoder
    return decoder is not None and (
        "ByteLevel" in type(decoder).__name__ or "ByteLevel" in str(decoder)
    )


def _raw_bytes(token: str, is_byte_level: bool) -> bytes:
    if is_byte_level:
        table = _unicode_to_byte()
        if all(ch in table for ch in token):
            return bytes(table[ch] for ch in token)
    match = _BYTE_FALLBACK.match(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word marker


def token_bytes_table(backend: HFTokenizer) -> list[bytes]:
    """Raw bytes of each token id (added / special tokens: their text's UTF-8)."""
    is_byte_level = _is_byte_level(backend)
    special = {t.content for t in backend.get_added_tokens_decoder().values()}
    table: list[bytes] = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(token_id) or ""
        table.append(token.encode() if token in special else _raw_bytes(token, is_byte_level))
    return table


def display_token(raw: bytes) -> str:
    """The token as text: itself when it is whole UTF-8, else `bytes:\\xNN...`."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return _BYTES_PREFIX + "".join(f"\\x{b:02x}" for b in raw)


def parse_display_token(text: str) -> bytes:
    """Inverse of display_token."""
    if text.startswith(_BYTES_PREFIX):
        hex_digits = text[len(_BYTES_PREFIX):].split("\\x")[1:]
        if hex_digits and all(len(h) == 2 for h in hex_digits):
            try:
                return bytes(int(h, 16) for h in hex_digits)
            except ValueError:
                pass
    return text.encode("utf-8")


class TextOffsets:
    """Where each token starts in one choice's returned text, in characters: a token that
    ends inside a UTF-8 character adds nothing until the character completes."""

    def __init__(self, start: int = 0) -> None:
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, raw: bytes) -> int:
        """The offset of a token with these bytes; advances past it."""
        start = self.offset
        self.offset += len(self._decoder.decode(raw))
        return start
