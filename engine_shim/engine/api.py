"""The embedded engine's public domain types: what the shim (and tests) see of the engine.

Imports no gRPC and no torch, so the shim's validation and the router-facing conversions can
depend on it without loading a model. The engine core (`llm_engine.LLMEngine`) and its async
adapter (`async_engine.AsyncEngine`) speak only these types.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field


class EngineError(Exception):
    """Base of the domain errors. Each maps to exactly one gRPC status code in the shim."""


class InvalidRequestError(EngineError):
    """The caller sent something invalid (bad window, bad token id, bad sampling value)."""


class NotFoundError(EngineError):
    """A request id the engine does not know (e.g. abort of an unknown id is NOT an error)."""


class AlreadyExistsError(InvalidRequestError):
    """A request id that is already active in the engine."""


class FailedPreconditionError(EngineError):
    """The call is valid on its own but not in the current state (e.g. incompatible KV)."""


class PermissionDeniedError(EngineError):
    """The call asks the engine to act for an address or party it does not trust."""


class ResourceExhaustedError(EngineError):
    """Not enough KV pages / queue space to accept the request now."""


class UnavailableError(EngineError):
    """The engine is shutting down or otherwise cannot serve."""


class PreemptedError(ResourceExhaustedError):
    """A remote_send job (or other disaggregated work) was preempted for lack of KV pages;
    the caller should re-run the whole flow, as MLC's router does on finish_reason preempt."""


class RequestAbortedError(FailedPreconditionError):
    """The request was aborted (by abort() or a reservation's TTL) while a call awaited it."""


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    PREEMPT = "preempt"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. Defaults follow OpenAI (temperature 1, top_p 1)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_tokens: int | None = None  # None: up to the context length
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per position when logprobs is set (0..20)
    ignore_eos: bool = False
    cache_salt: str = ""  # prefix-cache scope: KV is reused only under the same salt


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str  # a partial UTF-8 character shows as U+FFFD here; token_bytes holds it exactly
    logprob: float
    token_bytes: bytes = b""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    token_bytes: bytes = b""  # the token's raw bytes (may be part of a UTF-8 character)


@dataclass(frozen=True)
class Delta:
    """New output of one choice of one request since the previous Delta.

    `text` is complete UTF-8 (never half a character); `finish_reason` is set on the last
    Delta of the choice. Stop strings are already cut from `text`.
    """

    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV was a prefix-cache hit
    transferred_tokens: int = 0  # prompt tokens whose KV another engine sent

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class GenerateOutput:
    """One step's worth of output for a request: deltas (one per choice that advanced) and,
    once every choice has finished, the usage."""

    request_id: str
    deltas: tuple[Delta, ...]
    usage: Usage | None = None

    @property
    def is_finished(self) -> bool:
        return self.usage is not None


# A GenerateOutput as plain tuples: (request_id, deltas, usage), each delta the Delta's
# fields in order. An engine core in a process of its own builds and sends these instead of
# the dataclasses (building and pickling a step's 128 outputs as dataclasses cost about 5x
# as much, inside the process that sets the engine's pace); the shim unpacks them.
PackedDelta = tuple[int, tuple[int, ...], str, tuple[TokenLogprob, ...], "FinishReason | None"]
PackedOutput = tuple[str, tuple[PackedDelta, ...], Usage | None]
# How a choice whose first output tokens another engine sampled goes on (start_generate's
# `continuations`): its index, those tokens, its generator state after them (b"": greedy).
Continuation = tuple[int, tuple[int, ...], bytes]
# Told a send's first tokens (remote_send's `first`): the output and each choice's generator
# state after its draw.
OnFirst = Callable[[GenerateOutput, tuple[bytes, ...]], None]


def unpack_output(packed: PackedOutput) -> GenerateOutput:
    request_id, deltas, usage = packed
    return GenerateOutput(request_id, tuple([Delta(*fields) for fields in deltas]), usage)


@dataclass(frozen=True)
class PrepRecvResult:
    """What prep_recv reserved on the receiver.

    `kv_segments` are MLC's `kv_append_metadata` integer list for one model:
    `[n_segments, begin_1, len_1, ...]` with absolute slot indices
    (`page_id * page_size + offset`); segment lengths sum to `end - prefix_matched_length`.
    """

    request_id: str
    end: int  # normalised (non-negative) window end
    prefix_matched_length: int
    kv_segments: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    """Everything a receiver must agree on before it accepts KV bytes from a sender."""

    model_fingerprint: str
    dtype: str  # e.g. "float32", "bfloat16"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int


@dataclass(frozen=True)
class KVChunk:
    """KV of the token positions [begin, begin + num_tokens) of a request.

    `data` is a contiguous CPU tensor of shape [num_layers, 2, num_tokens, num_kv_heads,
    head_dim] (2 = key, value) in the layout's dtype, typed `object` here so this module
    needs no torch.
    """

    begin: int
    num_tokens: int
    data: object


@dataclass(frozen=True)
class PrefixCacheStats:
    num_queries: int
    num_query_tokens: int
    num_hit_tokens: int
    num_cached_pages: int  # pages currently held by the prefix cache (referenced or evictable)
    num_evictable_pages: int


@dataclass(frozen=True)
class EngineCounters:
    """Lifetime counters of an engine's work, for its metrics (kept per step, never per
    token): steps run and their summed wall time, tokens sampled, preemptions, the KV
    pages PrepRecv reservations hold now, and the summed wall time the loop that drives the
    engine worked (steps, calls, outputs; its waits with no work left out)."""

    num_steps: int
    step_time_s: float
    num_sampled_tokens: int
    num_preemptions: int
    num_reserved_pages: int
    busy_time_s: float = 0.0


@dataclass(frozen=True)
class EngineStatus:
    model_id: str
    model_fingerprint: str
    kv_layout: KVLayout
    num_running_requests: int
    num_waiting_requests: int
    num_free_pages: int  # free pages incl. evictable prefix-cache pages
    num_total_pages: int
    num_reserved_requests: int  # prep_recv reservations awaiting start_generate
    max_context_length: int
    prefix_cache: PrefixCacheStats
    counters: EngineCounters | None = None  # None: the backend does not count (MLC)


# What an engine's status says that changes as it works, as plain values: running and
# waiting requests, free pages, reserved requests, PrefixCacheStats' fields, and
# EngineCounters' fields (None where the core does not count). The engine loop sends one with
# every batch it emits (building and pickling the EngineStatus dataclasses each time cost
# about 40 us a batch, in the process that sets the engine's pace); the constant rest
# travels once, in the status of the core's start-up facts (status_from_fields).
StatusFields = tuple[int, int, int, int, tuple[int, int, int, int, int],
                     "tuple[int, float, int, int, int, float] | None"]


def constant_status(
    model_id: str, model_fingerprint: str, kv_layout: KVLayout, num_total_pages: int,
    max_context_length: int,
) -> EngineStatus:
    """An idle engine's status: the constant part status_from_fields completes."""
    return EngineStatus(
        model_id=model_id, model_fingerprint=model_fingerprint, kv_layout=kv_layout,
        num_running_requests=0, num_waiting_requests=0, num_free_pages=num_total_pages,
        num_total_pages=num_total_pages, num_reserved_requests=0,
        max_context_length=max_context_length, prefix_cache=PrefixCacheStats(0, 0, 0, 0, 0),
    )


def status_from_fields(constant: EngineStatus, fields: StatusFields) -> EngineStatus:
    """`constant`'s model, layout and sizes with the changing values of `fields`."""
    running, waiting, free_pages, reserved, prefix, counters = fields
    return EngineStatus(
        model_id=constant.model_id,
        model_fingerprint=constant.model_fingerprint,
        kv_layout=constant.kv_layout,
        num_running_requests=running,
        num_waiting_requests=waiting,
        num_free_pages=free_pages,
        num_total_pages=constant.num_total_pages,
        num_reserved_requests=reserved,
        max_context_length=constant.max_context_length,
        prefix_cache=PrefixCacheStats(*prefix),
        counters=None if counters is None else EngineCounters(*counters),
    )
