"""OpenAI request models -> Router NewRequest messages, and router enums -> OpenAI strings."""

from __future__ import annotations

from gateway.errors import INVALID, GatewayError
from gateway.protocol.base import INT32_MAX, PatternHintsParam, SamplingFields
from gateway.protocol.chat import ChatCompletionRequest
from gateway.protocol.completion import CompletionRequest
from microserving.pattern_names import PATTERN_BY_NAME
from microserving.v1 import common_pb2, router_pb2

_FINISH_REASONS: dict[int, str] = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
    common_pb2.FINISH_REASON_PREEMPT: "abort",  # never sent by the router; kept total
}
MAX_LOGIT_BIAS = 100.0


def finish_reason_text(reason: int) -> str:
    return _FINISH_REASONS.get(reason, "stop")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    result: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise GatewayError(INVALID, f"logit_bias: key {key!r} is not a token id",
                               "logit_bias") from None
        if not 0 <= token_id <= INT32_MAX or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise GatewayError(INVALID, "logit_bias: token ids >= 0, biases in [-100, 100]",
                               "logit_bias")
        result[token_id] = value
    return result


def _hints(hints: PatternHintsParam | None) -> router_pb2.PatternHints | None:
    if hints is None:
        return None
    message = router_pb2.PatternHints(
        pattern=PATTERN_BY_NAME[hints.pattern] if hints.pattern else router_pb2.PATTERN_UNSPECIFIED)
    if hints.pd_balance_factor is not None:
        message.pd_balance_factor = hints.pd_balance_factor
    if hints.cache_aware is not None:
        message.cache_aware = hints.cache_aware
    return message


def sampling_params(request: SamplingFields, *, max_tokens: int | None, logprobs: bool,
                    top_logprobs: int) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(
        top_k=request.top_k, stop=request.stop_list, stop_token_ids=request.stop_token_ids or [],
        n=request.n, frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty, logit_bias=_logit_bias(request.logit_bias),
        logprobs=logprobs, top_logprobs=top_logprobs, ignore_eos=request.ignore_eos)
    if request.temperature is not None:
        params.temperature = request.temperature
    if request.top_p is not None:
        params.top_p = request.top_p
    if max_tokens is not None:
        params.max_tokens = max_tokens
    if request.seed is not None:
        params.seed = request.seed
    return params


def _new_request(request: SamplingFields, request_id: str, sampling: common_pb2.SamplingParams,
                 echo: bool) -> router_pb2.NewRequest:
    message = router_pb2.NewRequest(request_id=request_id, model=request.model,
                                    sampling=sampling, echo=echo)
    hints = _hints(request.microserving)
    if hints is not None:
        message.hints.CopyFrom(hints)
    return message


def completion_requests(request: CompletionRequest, base_id: str) -> list[router_pb2.NewRequest]:
    """One NewRequest per prompt, ids `<base_id>-<prompt index>`."""
    logprobs = request.logprobs is not None
    sampling = sampling_params(request, max_tokens=request.max_tokens, logprobs=logprobs,
                               top_logprobs=request.logprobs or 0)
    messages = []
    for index, prompt in enumerate(request.prompts):
        message = _new_request(request, f"{base_id}-{index}", sampling, request.echo)
        if isinstance(prompt, str):
            message.text = prompt
        else:
            message.token_ids.ids.extend(prompt)
        messages.append(message)
    return messages


def chat_request(request: ChatCompletionRequest, base_id: str) -> router_pb2.NewRequest:
    sampling = sampling_params(request, max_tokens=request.max_new_tokens,
                               logprobs=request.logprobs, top_logprobs=request.top_logprobs or 0)
    message = _new_request(request, f"{base_id}-0", sampling, echo=False)
    for turn in request.messages:
        role = "system" if turn.role == "developer" else turn.role
        message.chat.messages.add(role=role, content=turn.text)
    message.chat.add_generation_prompt = request.add_generation_prompt
    return message
