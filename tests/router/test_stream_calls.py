"""The router makes a disagg request's PrepRecv and RemoteSend on the engines' multiplexed
Generate streams (a message each, not a call each) when the engines say they serve them
there, and the tokens are exactly one engine's alone; with the engine streams off
(`engine_stream=False`) the same calls go unary and give the same tokens."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from router_stack import (
    disagg_matches_one_engine,
    generate,
    greedy,
    router_settings,
    running_router,
    wait_for,
)

import router.attempt as attempt_module
import router.prefix_index as prefix_index_module
from microserving.v1 import engine_pb2, router_pb2
from router.engines import EngineStream
from router.router import Router

_ids = itertools.count()


@pytest.mark.parametrize("engine_stream", [True, False])
async def test_disagg_calls_ride_the_engine_streams(shims, monkeypatch, engine_stream: bool) -> None:
    made: list[tuple[str, str]] = []  # (call, engine address) of every call made on a stream
    prompts: list[list[int]] = []  # the ids each of those calls carried
    real_call = EngineStream.call

    async def recorded(self: EngineStream, request_id: str, message: engine_pb2.EngineGenerateRequest,
                       timeout_s: float | None, on_first: Any = None) -> Any:
        action = str(message.WhichOneof("action"))
        made.append((action, self.endpoint.address))
        prompts.append(list(getattr(message, action).token_ids))
        return await real_call(self, request_id, message, timeout_s, on_first)

    monkeypatch.setattr(EngineStream, "call", recorded)
    prefill, decode = shims[0].address, shims[1].address
    # A prompt no engine has cached, long enough for P to send KV.
    prompt = [*range(30, 90), 7 + next(_ids)]
    await disagg_matches_one_engine(shims, prompt, engine_stream=engine_stream)
    expected = [("prep_recv", decode), ("remote_send", prefill)] if engine_stream else []
    assert made == expected
    assert prompts == [prompt] * len(expected)  # the attempt's one wire copy of the prompt


@pytest.mark.parametrize("start_after_kv", [True, False])
async def test_disagg_starts_the_decode_with_the_send_where_the_engine_waits_for_the_kv(
    shims, monkeypatch, start_after_kv: bool
) -> None:
    """With start_after_kv (the default) D's start goes out before P's RemoteSend has
    returned, marked to wait for the KV on D; off, it goes out after. Tokens are one engine's
    alone either way."""
    events: list[str] = []
    real_call, real_start = EngineStream.call, EngineStream.start

    async def call(self: EngineStream, request_id: str, message: engine_pb2.EngineGenerateRequest,
                   timeout_s: float | None, on_first: Any = None) -> Any:
        reply = await real_call(self, request_id, message, timeout_s, on_first)
        events.append(f"{message.WhichOneof('action')} returned")
        return reply

    async def start(self: EngineStream, request: engine_pb2.StartGenerateRequest, sink: Any) -> None:
        events.append(f"start after_kv={request.after_kv_transfer}")
        await real_start(self, request, sink)

    monkeypatch.setattr(EngineStream, "call", call)
    monkeypatch.setattr(EngineStream, "start", start)
    await disagg_matches_one_engine(shims, [*range(40, 100), 7 + next(_ids)], start_after_kv=start_after_kv)
    if start_after_kv:
        assert events == ["prep_recv returned", "start after_kv=True", "remote_send returned"]
    else:
        assert events == ["prep_recv returned", "remote_send returned", "start after_kv=False"]


@pytest.mark.parametrize("pattern", ["disagg", "adaptive-disagg", "round-robin"])
async def test_a_request_hashes_its_prompt_once_for_placement_and_records(shims, monkeypatch, pattern: str) -> None:
    """Cache-aware placement of D, then of P, and the records of what each engine now holds
    use one computation of the prompt's page hashes (EngineJob.page_chain), and the router's
    index holds exactly what hashing each record's prompt would have given."""
    real_chain = prefix_index_module.page_hash_chain
    hashed: list[int] = []

    def counting(token_ids: Any, page_size: int, salt: str = "") -> list[bytes]:
        hashed.append(len(token_ids))
        return real_chain(token_ids, page_size, salt)

    monkeypatch.setattr(attempt_module, "page_hash_chain", counting)
    monkeypatch.setattr(prefix_index_module, "page_hash_chain", counting)
    prefill, decode = shims[0].address, shims[1].address
    engines = [f"{prefill}=prefill", f"{decode}=decode"] if pattern != "round-robin" else [decode]
    router_ = Router(settings=router_settings(engines, pattern=pattern, cache_aware=True))
    prompt = [*range(100, 170), 3 + next(_ids)]  # 71 ids: 4 full pages of 16
    async with running_router(router_) as (_, stub):
        async def statuses_known() -> bool:
            return all(e.status is not None for e in router_.registry.endpoints)

        assert await wait_for(statuses_known)
        results = await generate(stub, router_pb2.NewRequest(
            request_id="once", token_ids=router_pb2.TokenIds(ids=prompt), sampling=greedy(max_tokens=2)))
        assert results["once"].error is None, results["once"].error
        assert hashed == [len(prompt)]
        index = router_.placement.prefix_index
        chain = real_chain(prompt, index.page_size)
        assert index.matched_tokens(decode, chain) == 64
        if pattern != "round-robin" and len(results["once"].done.engines) == 2:
            # P holds the window it computed: every full page before D's part
            assert 0 < index.matched_tokens(prefill, chain) <= 64
