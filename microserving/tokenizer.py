"""The tokenizer every service shares: a byte-level preset built in code, or a local Hugging Face
directory (tokenizer.json + tokenizer_config.json), plus UTF-8-safe incremental decoding.

Imports no torch and no gRPC, so the router can tokenize without loading an engine.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from microserving.token_bytes import token_bytes_table

# Preset names that give the byte-level tokenizer (every model preset uses it).
PRESET_NAMES: tuple[str, ...] = ("tiny", "llama-100m", "llama-1b")
# The --model help of every command (one list of built-in models).
MODEL_HELP = f"model preset ({', '.join(PRESET_NAMES)}; default tiny) or a local Hugging Face directory"

# Texts from this many characters are encoded without holding the GIL (see encode).
GIL_FREE_MIN_CHARS = 16_384

# Byte tokens take ids 0..255 (id == byte value); the specials follow in this order.
BYTE_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|pad|>",
)

# Output already starts with bos: encode a rendered chat with add_special_tokens=False.
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Text <-> token ids, chat templating, and the ids that end a generation."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None,
        eos_tokens: Sequence[str],
        chat_template: str | None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self._bos_token = bos_token
        self._bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        eos_ids = [backend.token_to_id(t) for t in eos_tokens]
        eos_ids += list(extra_eos_token_ids)
        # dict.fromkeys keeps order and drops duplicates / unknown tokens.
        self._eos_token_ids = tuple(dict.fromkeys(i for i in eos_ids if i is not None))
        self._eos_token = eos_tokens[0] if eos_tokens else None
        self._chat_template = chat_template
        self._template: jinja2.Template | None = None
        self._token_bytes: list[bytes] | None = None  # built on first use (whole vocabulary)

    # ---- construction ----
    @classmethod
    def from_model(cls, name_or_dir: str) -> Tokenizer:
        """A preset name (see PRESET_NAMES) or a local Hugging Face model directory."""
        if name_or_dir in PRESET_NAMES:
            return cls.byte_level()
        path = Path(name_or_dir)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(
                f"unknown tokenizer {name_or_dir!r}: not a preset {PRESET_NAMES} "
                "and not a directory holding tokenizer.json"
            )
        return cls.from_dir(path)

    @classmethod
    def byte_level(cls) -> Tokenizer:
        backend = build_byte_level_backend()
        return cls(
            backend,
            bos_token="<|bos|>",
            eos_tokens=("<|eos|>", "<|end|>"),
            chat_template=BYTE_CHAT_TEMPLATE,
        )

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")
        bos = _token_content(config.get("bos_token"))
        eos = _token_content(config.get("eos_token"))
        extra_eos = _as_id_list(generation.get("eos_token_id", model_config.get("eos_token_id")))
        if bos is None and "bos_token_id" in model_config:
            bos = _id_to_token(backend, model_config["bos_token_id"])
        return cls(
            backend,
            bos_token=bos,
            eos_tokens=(eos,) if eos else (),
            chat_template=find_chat_template(path, config),
            extra_eos_token_ids=extra_eos,
        )

    # ---- properties ----
    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters the longest vocabulary entry spells (a byte-level entry spells one
        character per byte, and a character of text takes at least one byte): a text of
        c characters encodes to at least c / max_token_chars tokens, unless a normalizer
        drops characters. Lets a caller refuse a text too long for any context without
        tokenizing it."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return max((len(token) for token in vocab), default=1)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    # ---- text <-> ids ----
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= GIL_FREE_MIN_CHARS:
            # encode_batch lets go of the GIL (encode does not): a long text tokenized in a
            # worker thread then leaves the caller's event loop running.
            encoded = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
            return list(encoded[0].ids)
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token_text(self, token_id: int) -> str:
        """The text of one token, for logprobs (a partial UTF-8 byte shows as U+FFFD)."""
        return self.decode([token_id], skip_special_tokens=False)

    def id_to_token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (part of a UTF-8 character for some tokens)."""
        if self._token_bytes is None:
            self._token_bytes = token_bytes_table(self._backend)
        return self._token_bytes[token_id]

    @functools.cached_property
    def decode_skips(self) -> tuple[int, frozenset[int]]:
        """(size, specials): the vocabulary's size with its added tokens, and the special
        tokens' ids. decode() leaves out the specials (when skipping them) and every id
        without a token, which past `size` is what `has_token` says (below it, nearly never:
        a vocabulary with holes). Cheap: no walk of the vocabulary."""
        specials = frozenset(
            i for i, token in self._backend.get_added_tokens_decoder().items() if token.special
        )
        return self.vocab_size, specials

    def has_token(self, token_id: int) -> bool:
        return self._backend.id_to_token(token_id) is not None

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # ---- chat ----
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render messages to prompt text. The text already holds the special tokens the
        template adds (e.g. bos), so encode it with add_special_tokens=False."""
        _validate_messages(messages)
        template = self._compiled_template()
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token or "",
                eos_token=self._eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    def _compiled_template(self) -> jinja2.Template:
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
            )
            env.globals["raise_exception"] = _raise_template_error
            env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
            self._template = env.from_string(self._chat_template)
        return self._template


class IncrementalDecoder:
    """Feeds token ids one step at a time and returns only complete text.

    Decodes a short window of ids (`prefix` = already-emitted tail, `read` = its end) and
    emits the new suffix only when it does not end in U+FFFD, i.e. a multi-byte character is
    never split across deltas. `flush()` returns whatever is still held back.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Ids decode() leaves out never enter the window: they cannot change its text, and
        # a run of them would otherwise hold the window open and grow every decode of it
        # (a model that samples ids past its tokenizer's vocabulary, or special tokens,
        # made the engine's text decoding quadratic in the run's length).
        self._vocab_size, specials = tokenizer.decode_skips
        self._specials = specials if skip_special_tokens else frozenset()
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def feed(self, token_ids: Iterable[int]) -> str:
        ids, count = self._ids, len(self._ids)
        for token_id in token_ids:
            if token_id < self._vocab_size:
                if token_id not in self._specials:
                    ids.append(token_id)
            elif self._tokenizer.has_token(token_id):
                ids.append(token_id)
        if len(ids) == count:
            return ""  # nothing that decodes to text
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode(self, begin: int, end: int) -> str:
        if begin >= end:
            return ""
        return self._tokenizer.decode(self._ids[begin:end], self._skip_special_tokens)


def build_byte_level_backend() -> HFTokenizer:
    """A `tokenizers` BPE with no merges over the 256 byte symbols: one token per byte."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable char; order the vocab by byte value so id == byte.
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    if set(vocab) != set(alphabet):
        raise RuntimeError("unexpected ByteLevel alphabet")
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in BYTE_SPECIAL_TOKENS])
    bos = BYTE_SPECIAL_TOKENS[0]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A $B",
        special_tokens=[(bos, backend.token_to_id(bos))],
    )
    return backend


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable-unicode table that ByteLevel uses.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    next_code = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(next_code)
            next_code += 1
    return table


def _validate_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_content(token: object) -> str | None:
    # tokenizer_config.json spells special tokens either as a string or as an AddedToken dict.
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return str(token["content"])
    return None


def find_chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The chat template wherever transformers writes it, in the order it reads them:
    chat_template.jinja (transformers >= 4.50 / 5.x save_pretrained), chat_template.json
    (processors: {"chat_template": ...}), then tokenizer_config.json's chat_template."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = _read_json(path / "chat_template.json")
    return _chat_template_text(json_file.get("chat_template")) or _chat_template_text(
        tokenizer_config.get("chat_template"))


def _chat_template_text(template: object) -> str | None:
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


def _as_id_list(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _id_to_token(backend: HFTokenizer, token_id: object) -> str | None:
    if not isinstance(token_id, int):
        return None
    token = backend.id_to_token(token_id)
    return str(token) if token is not None else None
