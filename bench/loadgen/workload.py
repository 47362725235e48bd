"""What the load generator sends: synthetic prompts of chosen lengths, a short-chat mix, or a
JSONL file of prompts / chat conversations.

Synthetic prompts are random words. Without a tokenizer one word is taken as about one token
(true of common English words in BPE vocabularies); with one (`tiny`, `llama-100m` or a local
Hugging Face directory) the text is cut to exactly the wanted number of tokens. In
token-ids mode the prompt is sent as a list of token ids, so lengths are exact on any server
that accepts token-id prompts (this project's gateway, vLLM, MLC).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bench.loadgen.distributions import LengthDist, parse_length_dist

# Made-up syllables: no real text is needed, only words that tokenize like words.
_SYLLABLES = (
    "ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "den", "mar", "pel", "tor", "wen",
    "ba", "co", "fi", "gu", "ha", "jo", "pa", "qui", "ze", "ster", "lin",
)
_COMMON_WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on",
    "be", "at", "by", "this", "had", "not", "are", "but", "from", "or", "have", "an", "they",
    "which", "one", "you", "were", "all", "we", "her", "she", "there", "would", "their",
    "will", "when", "who", "him", "been", "has", "more", "if", "no", "out", "do", "so",
    "can", "what", "up", "said", "about", "other", "into", "than", "its", "time", "only",
    "could", "new", "them", "man", "some", "these", "then", "two", "first", "may", "any",
    "like", "now", "my", "such", "make", "over", "our", "even", "most", "me", "state",
    "after", "also", "made", "many", "did", "must", "before", "back", "see", "through",
    "way", "where", "get", "much", "go", "well", "your", "know", "should", "down", "work",
    "year", "because", "come", "people", "just", "each", "day", "long", "house", "water",
)
SHORT_CHAT_INPUT = "uniform:16,256"
SHORT_CHAT_OUTPUT = "uniform:16,128"
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."


class TextTokenizer(Protocol):
    def encode(self, text: str, /, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], /) -> str: ...


@dataclass(frozen=True)
class RequestSpec:
    """One request: a prompt (text or token ids) or chat messages, and its output budget.

    input_len is the intended prompt length in tokens (exact for token ids or with a
    tokenizer, estimated otherwise); the server's reported usage wins when it sends one.
    """

    max_tokens: int
    input_len: int
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None


@dataclass(frozen=True)
class WorkloadConfig:
    dataset: str = "synthetic"  # synthetic | short-chat | path of a JSONL file
    input_len: str = "3000"
    output_len: str = "100"
    prompt_token_ids: bool = False
    tokenizer: str | None = None
    seed: int = 0


def random_words(rng: random.Random, num_words: int) -> str:
    words = []
    for _ in range(num_words):
        if rng.random() < 0.8:
            words.append(rng.choice(_COMMON_WORDS))
        else:
            words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))))
    return " ".join(words)


def _fit_text(
    rng: random.Random, num_tokens: int, tokenizer: TextTokenizer | None
) -> tuple[str, list[int]]:
    """Random-word text of about num_tokens tokens, and its token ids (exact with a tokenizer;
    the UTF-8 bytes of the text, capped at num_tokens, without one)."""
    if tokenizer is None:
        text = random_words(rng, num_tokens)
        return text, list(text.encode("utf-8"))[:num_tokens]
    text, ids = "", list[int]()
    while len(ids) < num_tokens:
        text = (text + " " + random_words(rng, num_tokens)).strip()
        ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids[:num_tokens]
    return tokenizer.decode(ids), ids


def synthetic(
    cfg: WorkloadConfig, count: int, rng: random.Random, tokenizer: TextTokenizer | None
) -> list[RequestSpec]:
    input_dist, output_dist = _dists(cfg)
    specs = []
    for _ in range(count):
        num_in, num_out = input_dist.sample(rng), output_dist.sample(rng)
        text, ids = _fit_text(rng, num_in, tokenizer)
        prompt: str | list[int] = ids if cfg.prompt_token_ids else text
        specs.append(RequestSpec(max_tokens=num_out, input_len=num_in, prompt=prompt))
    return specs


def short_chat(
    cfg: WorkloadConfig, count: int, rng: random.Random, tokenizer: TextTokenizer | None
) -> list[RequestSpec]:
    input_dist, output_dist = _dists(cfg)
    specs = []
    for _ in range(count):
        num_in, num_out = input_dist.sample(rng), output_dist.sample(rng)
        text, _ = _fit_text(rng, num_in, tokenizer)
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": text + "?"},
        ]
        specs.append(RequestSpec(max_tokens=num_out, input_len=num_in, messages=messages))
    return specs


def from_jsonl(path: Path, count: int, default_max_tokens: int) -> list[RequestSpec]:
    """Lines of {"prompt": str | [ids]} or {"messages": [...]}, optional "max_tokens";
    cycled when the file holds fewer than `count` lines."""
    rows = [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no requests in the file")
    specs = [_spec_from_row(row, default_max_tokens, f"{path}:{i + 1}") for i, row in enumerate(rows)]
    return [specs[i % len(specs)] for i in range(count)]


def _spec_from_row(row: Any, default_max_tokens: int, where: str) -> RequestSpec:
    if not isinstance(row, dict) or not ({"prompt", "messages"} & row.keys()):
        raise ValueError(f"{where}: each line needs a 'prompt' or a 'messages' field")
    max_tokens = int(row.get("max_tokens", default_max_tokens))
    if "messages" in row:
        text_len = sum(len(str(m.get("content", "")).split()) for m in row["messages"])
        return RequestSpec(max_tokens, text_len, messages=list(row["messages"]))
    prompt = row["prompt"]
    input_len = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
    return RequestSpec(max_tokens, input_len, prompt=prompt)


def _dists(cfg: WorkloadConfig) -> tuple[LengthDist, LengthDist]:
    return parse_length_dist(cfg.input_len), parse_length_dist(cfg.output_len)


def is_local_model(name: str) -> bool:
    """A model whose tokenizer this machine has: a preset or a Hugging Face directory."""
    from microserving.tokenizer import PRESET_NAMES

    return name in PRESET_NAMES or (Path(name) / "tokenizer.json").is_file()


def load_tokenizer(name: str | None) -> TextTokenizer | None:
    if name is None:
        return None
    from microserving.tokenizer import Tokenizer

    return Tokenizer.from_model(name)


def build_workload(cfg: WorkloadConfig, count: int) -> list[RequestSpec]:
    """`count` requests of the configured dataset, the same for the same seed."""
    rng = random.Random(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer)
    if cfg.dataset == "synthetic":
        return synthetic(cfg, count, rng, tokenizer)
    if cfg.dataset == "short-chat":
        return short_chat(cfg, count, rng, tokenizer)
    path = Path(cfg.dataset)
    if not path.is_file():
        raise ValueError(f"dataset {cfg.dataset!r}: not synthetic, short-chat or a JSONL file")
    return from_jsonl(path, count, parse_length_dist(cfg.output_len).sample(rng))
