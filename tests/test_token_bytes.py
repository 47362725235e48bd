"""Raw token bytes and their text form: tokens that split a UTF-8 character keep their bytes
(not U+FFFD's), show as `bytes:\\xNN`, parse back, and advance text offsets only once the
character completes."""

from __future__ import annotations

from microserving.token_bytes import TextOffsets, display_token, parse_display_token
from microserving.tokenizer import Tokenizer


def test_byte_level_tokens_hold_their_raw_byte() -> None:
    tokenizer = Tokenizer.from_model("tiny")
    assert [tokenizer.id_to_token_bytes(i) for i in (0x41, 0xE2, 0x82, 0xAC)] == [b"A", b"\xe2", b"\x82", b"\xac"]
    assert tokenizer.id_to_token_text(0xE2) == "\ufffd"  # what the text alone would say


def test_partial_characters_display_as_bytes_and_parse_back() -> None:
    for raw in (b"\xe2", b"\xe2\x82", b"\xff", b"hi", "€".encode(), b""):
        assert parse_display_token(display_token(raw)) == raw
    assert display_token(b"\xe2\x82") == "bytes:\\xe2\\x82"
    assert display_token(b"\xe2") != display_token(b"\x82")
    assert parse_display_token("bytes: not hex") == b"bytes: not hex"


def test_text_offsets_count_characters_once_complete() -> None:
    offsets = TextOffsets()
    starts = [offsets.add(raw) for raw in (b"a", b"\xe2", b"\x82", b"\xac", b"b")]
    assert starts == [0, 1, 1, 1, 2] and offsets.offset == 3  # "a€b"
