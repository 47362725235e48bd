"""The built-in orchestration patterns, each an async generator over the Router's three
helpers (exactly what a custom translate_request writes): data parallel, disaggregation
(balanced, prefix-aware, any number of P and D), adaptive disaggregation, and context
migration. Each yields CompletionResponse chunks, or None when the engine preempted."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from microserving.v1 import router_pb2
from router.context import RequestContext
from router.endpoint import DECODE, PREFILL, Endpoint
from router.errors import InvalidRequestError
from router.microserving_protocol import PrepRecvRequest, RemoteSendRequest, StartGenerateRequest
from router.openai_protocol import CompletionRequest, CompletionResponse
from router.policies import adaptive_split, balanced_end, normalise_end

if TYPE_CHECKING:
    from router.router import Router

Chunks = AsyncGenerator[CompletionResponse | None, None]
Pattern = Callable[["Router", CompletionRequest, str, RequestContext], Chunks]

_PATTERN_NAMES = {
    router_pb2.PATTERN_ROUND_ROBIN: "round-robin",
    router_pb2.PATTERN_DISAGG: "disagg",
    router_pb2.PATTERN_ADAPTIVE_DISAGG: "adaptive-disagg",
}


def pattern_for(router: Router, ctx: RequestContext) -> Pattern:
    name = _PATTERN_NAMES.get(ctx.hints.pattern, router.router_mode)
    if name == "round-robin":
        return round_robin
    if name == "disagg":
        # With no prefill engine in rotation (all died or stall) disagg degrades to the decode
        # engine alone rather than failing requests a decode engine can serve.
        return disagg
    return adaptive_disagg


def _prompt(request: CompletionRequest) -> list[int]:
    if not isinstance(request.prompt, list):
        raise InvalidRequestError("the prompt must be token ids here", param="prompt")
    return request.prompt


async def _generate(router: Router, request: CompletionRequest, begin: int, decode: Endpoint) -> Chunks:
    """start_generate(begin) on `decode`, turning a preempt chunk into None."""
    start = StartGenerateRequest(**request.model_dump(), begin=begin)
    async for response in router.send_start_generate(None, start, decode.address):
        if any(c.finish_reason == "preempt" for c in response.choices):
            yield None
            return
        yield response


async def round_robin(router: Router, request: CompletionRequest, request_id: str, ctx: RequestContext) -> Chunks:
    """Data parallel (MLC's "round-robin"): the least-loaded engine runs the whole request."""
    del request_id
    prompt = _prompt(request)
    engine = router.select_engine(DECODE, prompt, ctx)
    router.prefix_index.record(engine.address, prompt)
    async for response in _generate(router, request, 0, engine):
        yield response


async def _disagg_with_factor(
    router: Router, request: CompletionRequest, ctx: RequestContext, factor: float,
    decode: Endpoint, prefill: Endpoint | None,
) -> Chunks:
    """prep_recv(D) -> remote_send(P) from D's matched prefix -> start_generate(D)."""
    prompt = _prompt(request)
    if prefill is None or prefill.address == decode.address or len(prompt) < 2:
        async for response in _generate(router, request, 0, decode):
            yield response
        return
    end = balanced_end(factor, len(prompt))
    decode_start = normalise_end(end, len(prompt))
    fields = request.model_dump()
    kv_addr_info, matched = await router.send_prepare_receive(
        None, PrepRecvRequest(**fields, end=end), decode.address
    )
    if matched < decode_start:
        remote = RemoteSendRequest(
            **fields, begin=matched, end=end, kv_addr_info=kv_addr_info,
            recv_rank=router.device_id_start(decode.address),
        )
        await router.send_remote_send(None, remote, prefill.address)
    router.prefix_index.record(prefill.address, prompt[:decode_start])
    router.prefix_index.record(decode.address, prompt)
    async for response in _generate(router, request, decode_start, decode):
        yield response


def _factor(router: Router, ctx: RequestContext) -> float:
    if ctx.hints.HasField("pd_balance_factor"):
        factor = ctx.hints.pd_balance_factor
        if not 0.0 <= factor < 1.0:
            raise InvalidRequestError("pd_balance_factor must lie in [0, 1)", param="hints.pd_balance_factor")
        return factor
    return router.pd_balance_factor


async def disagg(router: Router, request: CompletionRequest, request_id: str, ctx: RequestContext) -> Chunks:
    """PD disaggregation over any number of P and D engines, balanced by the factor."""
    del request_id
    prompt = _prompt(request)
    decode = router.select_engine(DECODE, prompt, ctx)
    prefill = router.try_select_engine(PREFILL, prompt, ctx, avoid=[decode.address])
    async for response in _disagg_with_factor(router, request, ctx, _factor(router, ctx), decode, prefill):
        yield response


async def adaptive_disagg(router: Router, request: CompletionRequest, request_id: str, ctx: RequestContext) -> Chunks:
    """Per request: split from measured P and D load; D alone when little is uncached or
    P is the bottleneck (policy in policies.adaptive_split, described in docs/router.md)."""
    del request_id
    prompt = _prompt(request)
    decode = router.select_engine(DECODE, prompt, ctx)
    prefill = router.try_select_engine(PREFILL, prompt, ctx, avoid=[decode.address])
    cached = router.prefix_index.match_all([decode.address], prompt)[decode.address]
    if prefill is not None:
        decision = adaptive_split(
            router.adaptive_policy, num_prompt_tokens=len(prompt), num_cached_tokens=cached,
            prefill_load=prefill.load, decode_load=decode.load,
        )
        if decision.skip_prefill:
            prefill = None
        factor = decision.pd_balance_factor
    else:
        factor = 0.0
    if prefill is None:
        router.prefix_index.record(decode.address, prompt)
    async for response in _disagg_with_factor(router, request, ctx, factor, decode, prefill):
        yield response


async def migrate(router: Router, token_ids: list[int], source: str, target: str) -> tuple[int, int, str]:
    """Context migration: prep_recv(end=-1) on target, remote_send from source, then a
    one-token start_generate on target so the context lands in its prefix cache."""
    target_engine = router.registry.get(target)
    if target_engine is None or not target_engine.is_available:
        raise InvalidRequestError(f"target {target!r} is not an available engine", param="target")
    request_id = f"migrate-{uuid.uuid4().hex}"
    ctx = router.open_context(request_id)
    source = source or _choose_source(router, token_ids, target, ctx)
    fields: dict[str, Any] = {"prompt": token_ids, "user": request_id, "max_tokens": 1, "temperature": 0.0}
    try:
        kv_addr_info, matched = await router.send_prepare_receive(None, PrepRecvRequest(**fields, end=-1), target)
        end = len(token_ids) - 1
        moved = 0
        if matched < end:
            remote = RemoteSendRequest(
                **fields, begin=matched, end=-1, kv_addr_info=kv_addr_info,
                recv_rank=router.device_id_start(target),
            )
            await router.send_remote_send(None, remote, source)
            moved = end - matched
        async for _ in router.send_start_generate(None, StartGenerateRequest(**fields, begin=end), target):
            pass
    except BaseException:
        await router.abort_touched(ctx)
        raise
    finally:
        router.close_context(ctx)
    router.prefix_index.record(target, token_ids)
    return matched, moved, source


def _choose_source(router: Router, token_ids: list[int], target: str, ctx: RequestContext) -> str:
    candidates = router.registry.candidates(PREFILL, exclude=[target])
    if not candidates:
        raise InvalidRequestError("no source engine besides the target", param="source")
    matched = router.prefix_index.match_all([c.address for c in candidates], token_ids)
    best = max(candidates, key=lambda c: (matched[c.address], -c.load))
    del ctx
    return best.address
