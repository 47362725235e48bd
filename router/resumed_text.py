"""The text of a choice resumed on another engine, decoded by the router itself.

After a failure the next engine starts from prompt + tokens already streamed, so its own
detokenizer starts mid-stream: it misses what the failed engine still held back (the bytes
of an unfinished UTF-8 character, text that might have grown into a stop string) and cannot
see a stop string that straddles the boundary. The router therefore decodes every token of
the choice and sends only what lies past the text the client already has, with the engine's
rules: no trailing partial character and no possible stop-string prefix until the choice
finishes, and the text cut at the first stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from microserving.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class ResumedText:
    def __init__(self, tokenizer: Tokenizer, sent_text: str, stop: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._sent = sent_text
        self._stop = tuple(s for s in stop if s)
        self._max_stop_chars = max((len(s) for s in self._stop), default=0)

    def advance(self, all_token_ids: Sequence[int], is_finished: bool) -> tuple[str, bool]:
        """(new text for the client, True when a stop string ended the choice)."""
        full = self._tokenizer.decode(all_token_ids)
        is_stopped = False
        if self._stop:
            search_from = max(0, len(self._sent) - self._max_stop_chars)
            hits = [i for i in (full.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                full, is_stopped, is_finished = full[: min(hits)], True, True
        end = len(full)
        if not is_finished:
            end = len(full.rstrip(_REPLACEMENT_CHAR))
            if self._stop:
                end = min(end, len(full) - (self._max_stop_chars - 1))
        end = max(end, len(self._sent))
        new_text = full[len(self._sent) : end]
        self._sent += new_text
        return new_text, is_stopped
