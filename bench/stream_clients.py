"""Timed gRPC clients for the control-plane benchmark: the engine calls made directly (one
StartGenerate, or the PD flow PrepRecv -> RemoteSend -> StartGenerate issued by the client
itself) and one request over Router.Generate. They fill the load generator's RequestRecord,
so the same statistics apply at every depth."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from bench.loadgen.client import RequestRecord
from microserving.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

_ids = itertools.count()
STATUS_NAMES = {status.value[0]: status.name for status in grpc.StatusCode}


def sampling(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


@dataclass(frozen=True)
class DirectFlow:
    """The engine calls of a pattern, made by the client: data parallel over `engines`
    (alternating), or PD with `prefill` sending the prompt's KV to `decode` (end = -1)."""

    engines: Sequence[engine_pb2_grpc.EngineAsyncStub]
    prefill: engine_pb2_grpc.EngineAsyncStub | None = None

    @property
    def num_engine_calls(self) -> int:
        return 3 if self.prefill is not None else 1


async def _consume(
    stream: AsyncIterable[engine_pb2.StartGenerateResponse], record: RequestRecord, origin_s: float
) -> None:
    async for message in stream:
        now_s = time.perf_counter() - origin_s
        num_new = sum(len(choice.token_ids) for choice in message.choices)
        if num_new:
            if record.ttft_s is None:
                record.ttft_s = now_s - record.start_s
            record.chunk_times_s.append(now_s)
        if message.HasField("usage"):
            record.prompt_tokens = message.usage.prompt_tokens
            record.completion_tokens = message.usage.completion_tokens


async def _direct(flow: DirectFlow, token_ids: list[int], max_tokens: int, index: int,
                  record: RequestRecord, origin_s: float) -> None:
    request_id = new_request_id("direct")
    params = sampling(max_tokens)
    engine = flow.engines[index % len(flow.engines)]
    begin = 0
    if flow.prefill is not None:
        prep = await engine.PrepRecv(engine_pb2.PrepRecvRequest(
            request_id=request_id, token_ids=token_ids, end=-1, sampling=params))
        if prep.prefix_matched_length < prep.end:
            await flow.prefill.RemoteSend(engine_pb2.RemoteSendRequest(
                request_id=request_id, token_ids=token_ids, begin=prep.prefix_matched_length,
                end=prep.end, kv_addr_info=prep.kv_addr_info, sampling=params))
        begin = prep.end
    call = engine.StartGenerate(engine_pb2.StartGenerateRequest(
        request_id=request_id, token_ids=token_ids, begin=begin, sampling=params))
    await _consume(call, record, origin_s)


async def _via_router(router: router_pb2_grpc.RouterAsyncStub, token_ids: list[int], max_tokens: int,
                      record: RequestRecord, origin_s: float) -> None:
    request_id = new_request_id("router")
    call: Any = router.Generate()  # type: ignore[call-arg]  # the aio stub: no iterator
    await call.write(router_pb2.GenerateRequest(generate=router_pb2.NewRequest(
        request_id=request_id, token_ids=router_pb2.TokenIds(ids=token_ids),
        sampling=sampling(max_tokens))))
    await call.done_writing()  # the router finishes the request, then ends the call
    async for message in call:
        event = message.WhichOneof("event")
        now_s = time.perf_counter() - origin_s
        if event == "delta" and message.delta.token_ids:
            if record.ttft_s is None:
                record.ttft_s = now_s - record.start_s
            record.chunk_times_s.append(now_s)
        elif event == "done":
            record.prompt_tokens = message.done.usage.prompt_tokens
            record.completion_tokens = message.done.usage.completion_tokens
        elif event == "error":
            record.error = f"router_{STATUS_NAMES.get(message.error.code, message.error.code)}"
            record.error_detail = message.error.message[:300]


async def timed(coro_factory: Callable[[], Awaitable[None]], record: RequestRecord, origin_s: float) -> None:
    """Run one request, stamping start/end and turning a failure into the record's error."""
    record.start_s = time.perf_counter() - origin_s
    try:
        await coro_factory()
    except asyncio.CancelledError:
        raise
    except grpc.aio.AioRpcError as exc:
        record.error = f"grpc_{exc.code().name}"
        record.error_detail = (exc.details() or "")[:300]
    except Exception as exc:  # a benchmark records failures instead of stopping
        record.error = type(exc).__name__
        record.error_detail = str(exc)[:300]
    record.end_s = time.perf_counter() - origin_s


async def run_direct(flow: DirectFlow, token_ids: list[int], max_tokens: int, index: int,
                     record: RequestRecord, origin_s: float) -> None:
    await timed(lambda: _direct(flow, token_ids, max_tokens, index, record, origin_s),
                record, origin_s)


async def run_router(router: router_pb2_grpc.RouterAsyncStub, token_ids: list[int], max_tokens: int,
                     record: RequestRecord, origin_s: float) -> None:
    await timed(lambda: _via_router(router, token_ids, max_tokens, record, origin_s),
                record, origin_s)
