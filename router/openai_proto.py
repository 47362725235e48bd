"""Proto <-> pydantic conversions between the wire (engine and router protos) and the
programmable API's OpenAI-shaped models. Pure functions; no I/O."""

from __future__ import annotations

import time
from typing import Any

from microserving.v1 import common_pb2, engine_pb2
from router.openai_protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    LogProbs,
    LogProbsContent,
    TopLogProbs,
    UsageInfo,
)

FINISH_TO_TEXT: dict[int, str] = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_PREEMPT: "preempt",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}
TEXT_TO_FINISH: dict[str, int] = {text: code for code, text in FINISH_TO_TEXT.items()}


def sampling_to_request_fields(sampling: common_pb2.SamplingParams) -> dict[str, Any]:
    """CompletionRequest fields (MLC names) carrying a proto SamplingParams."""
    fields: dict[str, Any] = {
        "top_k": sampling.top_k,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "stop": list(sampling.stop) or None,
        "stop_token_ids": list(sampling.stop_token_ids) or None,
        "logit_bias": dict(sampling.logit_bias) or None,
        "logprobs": sampling.top_logprobs if sampling.logprobs else None,
        "debug_config": {"ignore_eos": sampling.ignore_eos},
        "cache_salt": sampling.cache_salt or None,
    }
    for name in ("temperature", "top_p", "max_tokens", "seed", "n"):
        if sampling.HasField(name):
            fields[name] = getattr(sampling, name)
    return fields


def engine_sampling(sampling: common_pb2.SamplingParams, max_tokens: int | None = None) -> common_pb2.SamplingParams:
    """The SamplingParams the engines get for a client's: what
    request_to_sampling(CompletionRequest(**sampling_to_request_fields(sampling))) gives (n set,
    top_logprobs only with logprobs), built without the pydantic round trip. `max_tokens`
    replaces the client's (a resume asks for what is left)."""
    out = common_pb2.SamplingParams()
    out.CopyFrom(sampling)
    if not out.HasField("n"):
        out.n = 1
    if not out.logprobs:
        out.top_logprobs = 0
    if max_tokens is not None:
        out.max_tokens = max_tokens
    return out


def request_to_sampling(request: CompletionRequest) -> common_pb2.SamplingParams:
    """The engine's SamplingParams for a CompletionRequest."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or ())
    sampling = common_pb2.SamplingParams(
        top_k=request.top_k,
        stop=stop,
        stop_token_ids=request.stop_token_ids or (),
        n=request.n,
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        logit_bias=request.logit_bias or {},
        logprobs=request.logprobs is not None,
        top_logprobs=request.logprobs or 0,
        ignore_eos=bool(request.debug_config and request.debug_config.ignore_eos),
        cache_salt=request.cache_salt or "",
    )
    if request.temperature is not None:
        sampling.temperature = request.temperature
    if request.top_p is not None:
        sampling.top_p = request.top_p
    if request.max_tokens is not None:
        sampling.max_tokens = request.max_tokens
    if request.seed is not None:
        sampling.seed = request.seed
    return sampling


def _logprobs(delta: common_pb2.ChoiceDelta) -> LogProbs | None:
    if not delta.logprobs:
        return None
    return LogProbs(
        content=[
            LogProbsContent(
                token=lp.token,
                logprob=lp.logprob,
                bytes=list(lp.token_bytes),
                token_id=lp.token_id,
                top_logprobs=[
                    TopLogProbs(token=t.token, logprob=t.logprob, bytes=list(t.token_bytes))
                    for t in lp.top_logprobs
                ],
            )
            for lp in delta.logprobs
        ]
    )


def engine_to_completion(
    message: engine_pb2.StartGenerateResponse, response_id: str, model: str | None
) -> CompletionResponse:
    """One StartGenerate stream message as one CompletionResponse stream chunk.

    Built with model_construct: the values come from a typed proto, so validation would only
    cost time on the token relay path."""
    choices = [
        CompletionResponseChoice.model_construct(
            index=delta.index,
            text=delta.text,
            logprobs=_logprobs(delta),
            finish_reason=FINISH_TO_TEXT.get(delta.finish_reason),
            token_ids=list(delta.token_ids),
        )
        for delta in message.choices
    ]
    usage = None
    if message.HasField("usage"):
        usage = UsageInfo(
            prompt_tokens=message.usage.prompt_tokens,
            completion_tokens=message.usage.completion_tokens,
            total_tokens=message.usage.total_tokens,
            extra={"cached_tokens": message.usage.cached_tokens,
                   "kv_transferred_tokens": message.usage.kv_transferred_tokens},
        )
    return CompletionResponse.model_construct(
        id=response_id, choices=choices, created=int(time.time()), model=model,
        object="text_completion", usage=usage,
    )


def logprobs_to_proto(logprobs: LogProbs | None) -> list[common_pb2.TokenLogprob]:
    if logprobs is None:
        return []
    return [
        common_pb2.TokenLogprob(
            token_id=c.token_id or 0,
            token=c.token,
            token_bytes=bytes(c.bytes or ()),
            logprob=c.logprob,
            top_logprobs=[
                common_pb2.TopLogprob(token=t.token, token_bytes=bytes(t.bytes or ()), logprob=t.logprob)
                for t in c.top_logprobs
            ],
        )
        for c in logprobs.content
    ]
