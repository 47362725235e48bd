"""Token-exact: at temperature 0 every pattern gives exactly the tokens one engine gives alone,
through Router.Generate, on a cold prefix cache and again on a warm one; chat input included."""

from __future__ import annotations

import itertools

import pytest
from router_stack import (
    engine_alone,
    generate,
    greedy,
    kill_all,
    router_settings,
    running_router,
    start_shims,
)

from microserving.tokenizer import Tokenizer
from microserving.v1 import common_pb2, router_pb2
from router.router import Router

pytestmark = pytest.mark.integration

_ids = itertools.count()

# Each config: (roles per shim index, settings). Roles are assigned by the router.
CONFIGS = {
    "round-robin": (["both", "both"], {"pattern": "round-robin"}),
    "disagg-1p1d": (["prefill", "decode"], {"pattern": "disagg"}),
    "disagg-2p2d": (["prefill", "prefill", "decode", "decode"], {"pattern": "disagg"}),
    "disagg-f0.1": (["prefill", "decode"], {"pattern": "disagg", "pd_balance_factor": 0.1}),
    "disagg-f0.5": (["prefill", "prefill", "decode", "decode"], {"pattern": "disagg", "pd_balance_factor": 0.5}),
    "adaptive": (["prefill", "decode"], {"pattern": "adaptive-disagg", "adaptive_min_remote_tokens": 8}),
    "cache-aware-disagg": (["prefill", "prefill", "decode", "decode"],
                           {"pattern": "disagg", "cache_aware": True, "cache_min_match_tokens": 16}),
    "cache-aware-rr": (["both", "both", "both"], {"pattern": "round-robin", "cache_aware": True}),
}


def _prompts(tag: str) -> list[str]:
    # Unique per test, so the first pass meets a cold prefix cache; one shares a long prefix
    # with another so the warm pass exercises prefix_matched_length > 0 and skipped sends.
    shared = f"[{tag}] The quick brown fox jumps over the lazy dog near the river bank. " * 2
    return [shared + "What happens next?", shared + "Tell it again.", f"[{tag}] hi"]


@pytest.mark.parametrize("name", list(CONFIGS))
async def test_pattern_matches_single_engine_at_temperature_0(shims, name: str) -> None:
    roles, values = CONFIGS[name]
    engines = [f"{shim.address}={role}" for shim, role in zip(shims, roles, strict=False)]
    router = Router(settings=router_settings(engines, **values))
    tokenizer = Tokenizer.from_model("tiny")
    prompts = _prompts(f"{name}-{next(_ids)}")
    passes = []
    async with running_router(router) as (_, stub):
        for _warm in (False, True):  # cold prefix cache, then warm
            requests = [
                router_pb2.NewRequest(request_id=f"r{i}", text=p, sampling=greedy())
                for i, p in enumerate(prompts)
            ]
            passes.append(await generate(stub, *requests))
    # One engine alone, asked afterwards so the router's first pass met cold caches.
    expected = [
        await engine_alone(shims[-1].address, tokenizer.encode(p), greedy(), f"alone-{name}-{i}")
        for i, p in enumerate(prompts)
    ]
    for warm, results in zip((False, True), passes, strict=True):
        for i, want in enumerate(expected):
            got = results[f"r{i}"]
            assert got.error is None, (warm, got.error)
            assert got.token_ids == want, (name, warm, i)
            assert got.done is not None and got.done.usage.completion_tokens == len(want)
            assert got.finish[0] in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        if "disagg" in values["pattern"] and not warm:
            # Cold cache: the long prompts really went through a prefill and a decode
            # engine (warm, D may hold the whole window and skip remote_send).
            assert all(len(results[f"r{i}"].done.engines) == 2 for i in (0, 1)), name
        if warm:
            assert results["r1"].done.usage.cached_tokens > 0, name


@pytest.mark.parametrize("pattern", ["round-robin", "disagg"])
async def test_chat_input_matches_single_engine(shims, pattern: str) -> None:
    tokenizer = Tokenizer.from_model("tiny")
    tag = next(_ids)
    messages = [{"role": "system", "content": f"You are terse {tag}."}, {"role": "user", "content": "Name a colour."}]
    want = await engine_alone(shims[0].address, tokenizer.encode_chat(messages), greedy(), f"alone-chat-{tag}")
    engines = [f"{shims[0].address}=prefill", f"{shims[1].address}=decode"]
    if pattern == "round-robin":
        engines = [f"{shims[0].address}=both"]
    chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(**m) for m in messages])
    async with running_router(Router(settings=router_settings(engines, pattern=pattern))) as (_, stub):
        results = await generate(stub, router_pb2.NewRequest(request_id="c", chat=chat, sampling=greedy(), echo=True))
    got = results["c"]
    assert got.error is None and got.token_ids == want
    assert got.prompt is not None and list(got.prompt.token_ids) == tokenizer.encode_chat(messages)


async def test_token_id_input_matches_text_input(shims) -> None:
    tokenizer = Tokenizer.from_model("tiny")
    text = f"token ids {next(_ids)} in, tokens out"
    engines = [f"{shims[0].address}=prefill", f"{shims[1].address}=decode"]
    async with running_router(Router(settings=router_settings(engines, pattern="disagg"))) as (_, stub):
        results = await generate(
            stub,
            router_pb2.NewRequest(request_id="t", text=text, sampling=greedy()),
            router_pb2.NewRequest(request_id="i", token_ids=router_pb2.TokenIds(ids=tokenizer.encode(text)),
                                  sampling=greedy()),
        )
    assert results["t"].token_ids == results["i"].token_ids
    assert results["t"].text == results["i"].text


@pytest.fixture(scope="module")
def uncached_shims():
    """Two shims with the prefix cache off (`--enable-prefix-cache false`)."""
    started = start_shims(["both", "both"], ["--enable-prefix-cache", "false"])
    yield started
    kill_all(started)


@pytest.mark.parametrize("name", ["round-robin", "disagg-1p1d", "disagg-f0.1"])
async def test_pattern_without_prefix_cache_matches_single_engine(uncached_shims, name: str) -> None:
    roles, values = CONFIGS[name]
    engines = [f"{shim.address}={role}" for shim, role in zip(uncached_shims, roles, strict=True)]
    tokenizer = Tokenizer.from_model("tiny")
    prompts = _prompts(f"nocache-{name}-{next(_ids)}")
    async with running_router(Router(settings=router_settings(engines, **values))) as (_, stub):
        passes = []
        for _again in (False, True):  # the same prompts twice: nothing may be reused
            requests = [
                router_pb2.NewRequest(request_id=f"r{i}", text=p, sampling=greedy())
                for i, p in enumerate(prompts)
            ]
            passes.append(await generate(stub, *requests))
    expected = [
        await engine_alone(uncached_shims[-1].address, tokenizer.encode(p), greedy(), f"alone-nc-{name}-{i}")
        for i, p in enumerate(prompts)
    ]
    for results in passes:
        for i, want in enumerate(expected):
            got = results[f"r{i}"]
            assert got.error is None and got.token_ids == want, (name, i, got.error)
            if values["pattern"] == "round-robin":
                assert got.done.usage.cached_tokens == 0, (name, i)
            else:  # D never holds the prompt: every long request takes both engines
                assert len(got.done.engines) == 2 or i == 2, (name, i)
