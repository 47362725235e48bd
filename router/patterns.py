"""The built-in orchestration patterns, each an async generator over the wire-level engine
calls (engine_calls.py; the MLC-named helpers a custom translate_request uses wrap the same
calls): data parallel, disaggregation (balanced, prefix-aware, any number of P and D),
adaptive disaggregation, and context migration. Each returns the decode step unstarted
(`engine_calls.decode`: the request on the engine's multiplexed Generate stream on the
runner's fast path, else the StartGenerate stream); a preempt arrives in it as
FINISH_REASON_PREEMPT."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from microserving.v1 import common_pb2, router_pb2
from router import engine_calls
from router.context import RequestContext
from router.endpoint import DECODE, PREFILL, Endpoint
from router.engine_calls import EngineJob
from router.errors import InvalidRequestError
from router.policies import adaptive_split, balanced_end, normalise_end

if TYPE_CHECKING:
    from router.router import Router

# A pattern makes the engine calls that come before decoding, then hands back the decode
# step (not yet started) for the caller to run: no generator layer per token.
Messages = engine_calls.Messages
Decode = engine_calls.Decode
Pattern = Callable[["Router", EngineJob, RequestContext], Awaitable[Decode]]

_PATTERN_NAMES = {
    router_pb2.PATTERN_ROUND_ROBIN: "round-robin",
    router_pb2.PATTERN_DISAGG: "disagg",
    router_pb2.PATTERN_ADAPTIVE_DISAGG: "adaptive-disagg",
}


def pattern_name(router: Router, hints: router_pb2.PatternHints) -> str:
    """The built-in pattern a request runs: its hint, else the router's default."""
    return _PATTERN_NAMES.get(hints.pattern, router.router_mode)


def pattern_for(router: Router, ctx: RequestContext) -> Pattern:
    name = pattern_name(router, ctx.hints)
    if name == "round-robin":
        return round_robin
    if name == "disagg":
        # With no prefill engine in rotation (all died or stall) disagg degrades to the decode
        # engine alone rather than failing requests a decode engine can serve.
        return disagg
    return adaptive_disagg


async def round_robin(router: Router, job: EngineJob, ctx: RequestContext) -> Decode:
    """Data parallel (MLC's "round-robin"): the least-loaded engine runs the whole request."""
    engine = router.select_engine(DECODE, job.token_ids, ctx)
    router.prefix_index.record(engine.address, job.token_ids, job.sampling.cache_salt)
    return engine_calls.decode(router, engine, job, 0)


async def _disagg_with_factor(
    router: Router, job: EngineJob, factor: float, decode: Endpoint, prefill: Endpoint | None,
) -> Decode:
    """prep_recv(D) -> remote_send(P) from D's matched prefix -> start_generate(D)."""
    prompt = job.token_ids
    if prefill is None or prefill.address == decode.address or len(prompt) < 2:
        return engine_calls.decode(router, decode, job, 0)
    end = balanced_end(factor, len(prompt))
    decode_start = normalise_end(end, len(prompt))
    kv_addr_info, matched = await engine_calls.prep_recv(router, decode, job, end)
    if matched < decode_start:
        await engine_calls.remote_send(
            router, prefill, job, begin=matched, end=end, kv_addr_info=kv_addr_info,
            recv_rank=router.device_id_start(decode.address), receiver=decode.address,
        )
    salt = job.sampling.cache_salt
    router.prefix_index.record(prefill.address, prompt[:decode_start], salt)
    router.prefix_index.record(decode.address, prompt, salt)
    return engine_calls.decode(router, decode, job, decode_start)


def _factor(router: Router, ctx: RequestContext) -> float:
    if ctx.hints.HasField("pd_balance_factor"):
        factor = ctx.hints.pd_balance_factor
        if not 0.0 <= factor < 1.0:
            raise InvalidRequestError("pd_balance_factor must lie in [0, 1)", param="hints.pd_balance_factor")
        return factor
    return router.pd_balance_factor


async def disagg(router: Router, job: EngineJob, ctx: RequestContext) -> Decode:
    """PD disaggregation over any number of P and D engines, balanced by the factor."""
    decode = router.select_engine(DECODE, job.token_ids, ctx)
    prefill = router.try_select_engine(PREFILL, job.token_ids, ctx, avoid=[decode.address])
    return await _disagg_with_factor(router, job, _factor(router, ctx), decode, prefill)


async def adaptive_disagg(router: Router, job: EngineJob, ctx: RequestContext) -> Decode:
    """Per request: split from measured P and D load; D alone when little is uncached or
    P is the bottleneck (policy in policies.adaptive_split, described in docs/router.md)."""
    prompt = job.token_ids
    decode = router.select_engine(DECODE, prompt, ctx)
    prefill = router.try_select_engine(PREFILL, prompt, ctx, avoid=[decode.address])
    cached = router.prefix_index.match_all([decode.address], prompt, ctx.cache_salt)[decode.address]
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
        router.prefix_index.record(decode.address, prompt, job.sampling.cache_salt)
    return await _disagg_with_factor(router, job, factor, decode, prefill)


async def migrate(router: Router, token_ids: list[int], source: str, target: str) -> tuple[int, int, str]:
    """Context migration: prep_recv(end=-1) on target, remote_send from source, then a
    one-token start_generate on target so the context lands in its prefix cache."""
    target_engine = router.registry.get(target)
    if target_engine is None or not target_engine.is_available:
        raise InvalidRequestError(f"target {target!r} is not an available engine", param="target")
    request_id = f"migrate-{uuid.uuid4().hex}"
    ctx = router.open_context(request_id)
    try:
        source = source or _choose_source(router, token_ids, target, ctx)
        source_engine = router.endpoint(source)  # a registered engine, or InvalidRequestError
    except BaseException:
        router.close_context(ctx)
        raise
    job = EngineJob(request_id, token_ids, common_pb2.SamplingParams(max_tokens=1, temperature=0.0, n=1))
    try:
        kv_addr_info, matched = await engine_calls.prep_recv(router, target_engine, job, -1)
        end = len(token_ids) - 1
        moved = 0
        if matched < end:
            await engine_calls.remote_send(
                router, source_engine, job, begin=matched, end=-1, kv_addr_info=kv_addr_info,
                recv_rank=router.device_id_start(target), receiver=target,
            )
            moved = end - matched
        async with contextlib.aclosing(engine_calls.start_generate(router, target_engine, job, end)) as stream:
            async for _ in stream:
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
