"""The request each attempt sends: for the built-in patterns an `EngineJob` (token ids and
engine sampling), for a custom translate_request an MLC-style `CompletionRequest`. A resume
continues from prompt + the tokens already streamed, with max_tokens reduced by them, so no
text repeats."""

from __future__ import annotations

from collections.abc import Sequence

from microserving.v1 import common_pb2
from router.attempt import EngineJob
from router.openai_proto import engine_sampling, sampling_to_request_fields
from router.openai_protocol import CompletionRequest
from router.prepared_request import PreparedRequest


def max_tokens_of(sampling: common_pb2.SamplingParams) -> int | None:
    return sampling.max_tokens if sampling.HasField("max_tokens") else None


def engine_job(prepared: PreparedRequest, sampling: common_pb2.SamplingParams,
               streamed: Sequence[int], engine_request_id: str) -> EngineJob:
    """The built-in patterns' request; `sampling` is what the engines get on a first
    attempt (engine_sampling of the client's)."""
    if not streamed:
        return EngineJob(engine_request_id, list(prepared.token_ids), sampling)
    max_tokens = max_tokens_of(prepared.sampling)
    resumed = engine_sampling(sampling, None if max_tokens is None else max_tokens - len(streamed))
    return EngineJob(engine_request_id, [*prepared.token_ids, *streamed], resumed)


def completion_request(prepared: PreparedRequest, streamed: Sequence[int],
                       engine_request_id: str) -> CompletionRequest:
    """A custom translate_request's request (its `user` is the engine request id)."""
    fields = sampling_to_request_fields(prepared.sampling)
    max_tokens = max_tokens_of(prepared.sampling)
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens - len(streamed)
    return CompletionRequest.model_validate({
        **fields, "model": prepared.model, "stream": True, "user": engine_request_id,
        "prompt": [*prepared.token_ids, *streamed],
    })
