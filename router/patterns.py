"""The built-in orchestration patterns over the wire-level engine calls (engine_calls.py; the
MLC-named helpers a custom translate_request uses wrap the same calls): data parallel,
disaggregation (balanced, prefix-aware, any number of P and D), adaptive disaggregation, and
context migration. Each takes the engines, the placement and the attempt it runs for, makes
the calls that come before decoding and returns the decode step unstarted
(`engine_calls.decode`: the request on the engine's multiplexed Generate stream on the
runner's fast path, else the StartGenerate stream); a preempt arrives in it as
FINISH_REASON_PREEMPT."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable

import router.engine_calls as calls
from microserving.pattern_names import PatternName
from microserving.v1 import common_pb2
from router.attempt import Attempt, EngineJob
from router.endpoint import DECODE, PREFILL, Endpoint
from router.engine_calls import Decode
from router.engines import Engines
from router.errors import InvalidRequestError
from router.placement import Placement
from router.policies import adaptive_split, balanced_end, normalise_end

Pattern = Callable[[Engines, Placement, EngineJob, Attempt], Awaitable[Decode]]


async def round_robin(engines: Engines, placement: Placement, job: EngineJob, attempt: Attempt) -> Decode:
    """Data parallel (MLC's "round-robin"): the least-loaded engine runs the whole request."""
    engine = placement.select(DECODE, job, attempt)
    _record(placement, engine.address, job)
    return calls.decode(engines, engine, job, attempt, 0)


def _record(placement: Placement, address: str, job: EngineJob, num_tokens: int | None = None) -> None:
    """Note that `address` now caches the job's prompt (its first `num_tokens`), from the
    job's page hashes."""
    index = placement.prefix_index
    chain = job.page_chain(index.page_size, job.sampling.cache_salt)
    index.record_chain(address, chain if num_tokens is None else chain[:num_tokens // index.page_size])


async def _disagg_with_factor(
    engines: Engines, placement: Placement, job: EngineJob, attempt: Attempt, factor: float,
    decode: Endpoint, prefill: Endpoint | None,
) -> Decode:
    """prep_recv(D) -> remote_send(P) from D's matched prefix -> start_generate(D); the first
    two at once where P takes D's address later (send_ahead: P computes while D reserves),
    the last two at once where D can start after the KV transfer (engine_calls.decode_after)."""
    prompt = job.token_ids
    if prefill is None or prefill.address == decode.address or len(prompt) < 2:
        return calls.decode(engines, decode, job, attempt, 0)
    end = balanced_end(factor, len(prompt))
    decode_start = normalise_end(end, len(prompt))
    recv_rank = engines.device_id_start(decode.address)
    # P samples the first token where it computes the whole rest of the prompt anyway (D's
    # share is only the last position) and both engines serve it: the client's first token
    # then comes with P's prefill, before the KV transfer and D's first step. Not for n > 1:
    # a request of several choices cannot resume once it has streamed (request_runner), so a
    # D that fails or preempts after the first tokens would end it where, before them, it is
    # run again. D then receives the whole prompt's KV (P computed it all) and continues from
    # len(prompt): its first step is a plain decode of the first token, which joins D's decode
    # batch as any other row does, where the last prompt position would make it a prefill step.
    sends_ahead = calls.sends_ahead(engines, prefill, job, attempt)
    sample_first = sends_ahead and decode_start == len(prompt) - 1 and job.sampling.n <= 1 and \
        calls.samples_first(engines, prefill, decode, attempt)
    window_end = len(prompt) if sample_first else end
    ahead = calls.SendAhead(engines, prefill, job, attempt, end=window_end, receiver=decode.address,
                            sample_first=sample_first) if sends_ahead else None
    try:
        kv_addr_info, matched = await calls.prep_recv(engines, decode, job, attempt, window_end,
                                                      whole_prompt=sample_first)
    except BaseException:
        if ahead is not None:
            await ahead.cancel()
        raise
    def record() -> None:
        _record(placement, prefill.address, job, decode_start)
        _record(placement, decode.address, job)

    if matched >= decode_start:  # (a whole-prompt reservation matches at most len - 1)
        if ahead is not None:  # D holds the window: P's computation is undone
            await ahead.cancel()
        record()
        return calls.decode(engines, decode, job, attempt, decode_start)

    if ahead is not None:
        ahead.to(kv_addr_info, matched, recv_rank)  # now: P may have its KV ready

    async def send() -> None:
        if ahead is not None:
            await ahead.result()
        else:
            await calls.remote_send(
                engines, prefill, job, attempt, begin=matched, end=end, kv_addr_info=kv_addr_info,
                recv_rank=recv_rank, receiver=decode.address,
            )
        record()

    if ahead is not None and sample_first:
        return calls.decode_continuing(engines, decode, job, attempt, len(prompt), send, ahead.first)
    if calls.starts_after_kv(engines, decode, attempt):
        # D's start goes out with P's RemoteSend and begins as the KV lands in D: no round
        # trip through P's answer and this router between the KV and D's first step.
        return calls.decode_after(engines, decode, job, attempt, decode_start, send)
    await send()
    return calls.decode(engines, decode, job, attempt, decode_start)


async def disagg(engines: Engines, placement: Placement, job: EngineJob, attempt: Attempt) -> Decode:
    """PD disaggregation over any number of P and D engines, balanced by the factor. With no
    prefill engine in rotation (all died or stall) it degrades to the decode engine alone
    rather than failing requests a decode engine can serve."""
    decode = placement.select(DECODE, job, attempt)
    prefill = placement.try_select(PREFILL, job, attempt, avoid=[decode.address])
    factor = placement.factor_of(attempt)
    return await _disagg_with_factor(engines, placement, job, attempt, factor, decode, prefill)


async def adaptive_disagg(engines: Engines, placement: Placement, job: EngineJob, attempt: Attempt) -> Decode:
    """Per request: split from measured P and D load; D alone when little is uncached or
    P is the bottleneck (policy in policies.adaptive_split, described in docs/router.md)."""
    prompt = job.token_ids
    decode = placement.select(DECODE, job, attempt)
    prefill = placement.try_select(PREFILL, job, attempt, avoid=[decode.address])
    index = placement.prefix_index
    chain = job.page_chain(index.page_size, attempt.cache_salt)
    cached = index.match_chain([decode.address], chain)[decode.address]
    factor = 0.0
    if prefill is not None:
        decision = adaptive_split(
            placement.adaptive_policy, num_prompt_tokens=len(prompt), num_cached_tokens=cached,
            prefill_load=prefill.load, decode_load=decode.load,
        )
        if decision.skip_prefill:
            prefill = None
        factor = decision.pd_balance_factor
    if prefill is None:
        _record(placement, decode.address, job)
    return await _disagg_with_factor(engines, placement, job, attempt, factor, decode, prefill)


PATTERNS: dict[PatternName, Pattern] = {"round-robin": round_robin, "disagg": disagg, "adaptive-disagg": adaptive_disagg}


def pattern_for(placement: Placement, attempt: Attempt) -> Pattern:
    return PATTERNS[placement.pattern_of(attempt)]


async def migrate(
    engines: Engines, placement: Placement, token_ids: list[int], source: str, target: str
) -> tuple[int, int, str]:
    """Context migration: prep_recv(end=-1) on target, remote_send from source, then a
    one-token start_generate on target so the context lands in its prefix cache."""
    target_engine = engines.registry.get(target)
    if target_engine is None or not target_engine.is_available:
        raise InvalidRequestError(f"target {target!r} is not an available engine", param="target")
    source = source or placement.migration_source(token_ids, target)
    source_engine = engines.endpoint(source)  # a registered engine, or InvalidRequestError
    attempt = Attempt(f"migrate-{uuid.uuid4().hex}")
    job = EngineJob(attempt.engine_request_id, token_ids,
                    common_pb2.SamplingParams(max_tokens=1, temperature=0.0, n=1))
    try:
        matched, moved = await _migrate_calls(engines, job, attempt, source_engine, target_engine)
    except BaseException:
        await engines.abort_touched(attempt)
        raise
    finally:
        attempt.release_reservations()
    placement.prefix_index.record(target, token_ids)
    return matched, moved, source


async def _migrate_calls(
    engines: Engines, job: EngineJob, attempt: Attempt, source: Endpoint, target: Endpoint
) -> tuple[int, int]:
    kv_addr_info, matched = await calls.prep_recv(engines, target, job, attempt, -1)
    end = len(job.token_ids) - 1
    moved = 0
    if matched < end:
        await calls.remote_send(
            engines, source, job, attempt, begin=matched, end=-1, kv_addr_info=kv_addr_info,
            recv_rank=engines.device_id_start(target.address), receiver=target.address,
        )
        moved = end - matched
    async with contextlib.aclosing(calls.start_generate(engines, target, job, attempt, end)) as stream:
        async for _ in stream:
            pass
    return matched, moved
