"""proto <-> domain conversions for the Engine and KVTransfer services (`from_pb` / `to_pb`).
No validation here: the servicer validates the domain values these return."""

from __future__ import annotations

from engine_shim.backend import SendResult
from engine_shim.engine.api import (
    Continuation,
    Delta,
    EngineStatus,
    FinishReason,
    GenerateOutput,
    KVLayout,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from microserving.v1 import common_pb2, engine_pb2

_FINISH_TO_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.PREEMPT: common_pb2.FINISH_REASON_PREEMPT,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}

ROLE_TO_PB = {
    "prefill": [common_pb2.ENGINE_ROLE_PREFILL],
    "decode": [common_pb2.ENGINE_ROLE_DECODE],
    "both": [common_pb2.ENGINE_ROLE_BOTH],
}


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=pb.temperature if pb.HasField("temperature") else 1.0,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        top_k=pb.top_k,
        max_tokens=pb.max_tokens if pb.HasField("max_tokens") else None,
        stop=tuple(pb.stop),
        stop_token_ids=tuple(pb.stop_token_ids),
        seed=pb.seed if pb.HasField("seed") else None,
        n=pb.n if pb.HasField("n") else 1,
        frequency_penalty=pb.frequency_penalty,
        presence_penalty=pb.presence_penalty,
        logit_bias=dict(pb.logit_bias),
        logprobs=pb.logprobs,
        top_logprobs=pb.top_logprobs,
        ignore_eos=pb.ignore_eos,
        cache_salt=pb.cache_salt,
    )


def _logprob_to_pb(logprob: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=logprob.token_id,
        token=logprob.token,
        token_bytes=logprob.token_bytes or logprob.token.encode(),
        logprob=logprob.logprob,
        top_logprobs=[
            common_pb2.TopLogprob(
                token_id=top.token_id,
                token=top.token,
                token_bytes=top.token_bytes or top.token.encode(),
                logprob=top.logprob,
            )
            for top in logprob.top
        ],
    )


def delta_to_pb(delta: Delta) -> common_pb2.ChoiceDelta:
    return common_pb2.ChoiceDelta(
        index=delta.index,
        token_ids=list(delta.token_ids),
        text=delta.text,
        logprobs=[_logprob_to_pb(lp) for lp in delta.logprobs],
        finish_reason=_FINISH_TO_PB[delta.finish_reason],
    )


def usage_to_pb(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        cached_tokens=usage.cached_tokens,
        kv_transferred_tokens=usage.transferred_tokens,
    )


def generate_output_to_pb(output: GenerateOutput) -> engine_pb2.StartGenerateResponse:
    response = engine_pb2.StartGenerateResponse()
    add_generate_output(response, output)
    return response


def add_generate_output(
    message: engine_pb2.StartGenerateResponse | engine_pb2.GenerateOutput, output: GenerateOutput
) -> None:
    """Appends an engine output's deltas (and its usage, on the last) to a StartGenerate
    message or to a request's entry of an Engine.Generate batch."""
    message.choices.extend([delta_to_pb(d) for d in output.deltas])
    if output.usage is not None:
        message.usage.CopyFrom(usage_to_pb(output.usage))


def add_first_tokens(entry: engine_pb2.GenerateOutput, output: GenerateOutput, states: tuple[bytes, ...]) -> None:
    """A send's first tokens (RemoteSendRequest.sample_first_token) into its entry of an
    Engine.Generate batch: the deltas (and usage, if every choice ended) and how each choice
    continues on the receiver."""
    add_generate_output(entry, output)
    entry.continuations.extend([
        engine_pb2.ChoiceContinuation(index=d.index, token_ids=d.token_ids, sampler_state=state)
        for d, state in zip(output.deltas, states, strict=True)
    ])


def continuations_from_pb(request: engine_pb2.StartGenerateRequest) -> tuple[Continuation, ...]:
    return tuple((c.index, tuple(c.token_ids), c.sampler_state) for c in request.continuations)


def layout_to_pb(layout: KVLayout) -> engine_pb2.KVLayout:
    return engine_pb2.KVLayout(
        model_fingerprint=layout.model_fingerprint,
        dtype=layout.dtype,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        page_size=layout.page_size,
    )


def layout_from_pb(pb: engine_pb2.KVLayout) -> KVLayout:
    return KVLayout(
        model_fingerprint=pb.model_fingerprint,
        dtype=pb.dtype,
        num_layers=pb.num_layers,
        num_kv_heads=pb.num_kv_heads,
        head_dim=pb.head_dim,
        page_size=pb.page_size,
    )


def send_result_to_pb(result: SendResult) -> engine_pb2.RemoteSendResponse:
    return engine_pb2.RemoteSendResponse(
        num_tokens_sent=result.num_tokens_sent,
        num_bytes_sent=result.num_bytes_sent,
        num_cached_tokens=result.num_cached_tokens,
    )


def status_to_pb(
    status: EngineStatus, *, backend: str, device: str, role: str, is_draining: bool
) -> engine_pb2.GetStatusResponse:
    cache = status.prefix_cache
    return engine_pb2.GetStatusResponse(
        model_id=status.model_id,
        kv_layout=layout_to_pb(status.kv_layout),
        roles=ROLE_TO_PB[role],
        num_running_requests=status.num_running_requests,
        num_waiting_requests=status.num_waiting_requests,
        num_reserved_requests=status.num_reserved_requests,
        num_free_kv_pages=status.num_free_pages,
        num_total_kv_pages=status.num_total_pages,
        max_context_length=status.max_context_length,
        prefix_cache=engine_pb2.PrefixCacheStats(
            num_queries=cache.num_queries,
            num_query_tokens=cache.num_query_tokens,
            num_hit_tokens=cache.num_hit_tokens,
            num_cached_pages=cache.num_cached_pages,
            num_evictable_pages=cache.num_evictable_pages,
        ),
        backend=backend,
        device=device,
        is_draining=is_draining,
    )
