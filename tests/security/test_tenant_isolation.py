"""Tenant isolation of the prefix cache: the gateway scopes each request's prefix cache by
its API key (and an explicit `cache_salt`), in the router's cache-aware choice and in the
engines' caches, so one key's prompts never show in another key's usage (through a custom
translate_request that drops the salt too); and under PD
disaggregation `cached_tokens` counts only prefix-cache hits, not the KV the prefill engine
sent (reported separately on the gRPC side as kv_transferred_tokens)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from stack_procs import Service, start_gateway, start_router, start_shims, stop_all

from microserving.transport import TransportSettings, create_channel
from microserving.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.e2e

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-9876543210"
SECRET = "The launch code of tenant A is 4242, keep it under wraps. " * 3  # ~180 bytes: 11 pages
# The same length, differing from the first byte (so it shares no page with SECRET in B's own
# scope either).
WRONG = "Xhe launch code of tenant A is 1717, keep it under wraps. " * 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("tenants")
    prefill, decode = start_shims(logs, ["prefill", "decode"])
    router = start_router(logs, [f"{prefill.address}=prefill", f"{decode.address}=decode"],
                          "--pattern", "disagg", "--cache-aware")
    gateway = start_gateway(logs, router.address, "--api-key", KEY_A, "--api-key", KEY_B)
    services = {"prefill": prefill, "decode": decode, "router": router, "gateway": gateway}
    yield services
    stop_all(services.values())


@pytest.fixture(scope="module", params=["SaltDroppingRouter", "IdRenamingSaltDroppingRouter"])
def custom_stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[dict[str, Service]]:
    """A custom translate_request (--router-class) that drops cache_salt from what it sends
    (and, the second, makes its engine call under a request id of its own)."""
    logs = tmp_path_factory.mktemp("tenants-custom")
    (shim,) = start_shims(logs, ["both"])
    router_class = f"{Path(__file__).parent / 'salt_dropping_router.py'}:{request.param}"
    router = start_router(logs, [shim.address], "--router-class", router_class)
    gateway = start_gateway(logs, router.address, "--api-key", KEY_A, "--api-key", KEY_B)
    services = {"shim": shim, "router": router, "gateway": gateway}
    yield services
    stop_all(services.values())


def _usage(gateway: Service, key: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    reply = httpx.post(f"http://{gateway.address}/v1/completions", json=body,
                       headers={"authorization": f"Bearer {key}"}, timeout=120)
    assert reply.status_code == 200, reply.text
    usage: dict[str, Any] = reply.json()["usage"]
    return usage


def _cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def test_another_key_cannot_tell_a_right_guess_from_a_wrong_one(stack: dict[str, Service]) -> None:
    gateway = stack["gateway"]
    first = _usage(gateway, KEY_A, SECRET)
    again = _usage(gateway, KEY_A, SECRET)
    assert _cached(first) == 0  # KV sent by the prefill engine is not a cache hit
    assert _cached(again) >= 160  # the same tenant reuses its own cache
    right_guess = _usage(gateway, KEY_B, SECRET)
    wrong_guess = _usage(gateway, KEY_B, WRONG)
    assert right_guess == wrong_guess, (right_guess, wrong_guess)
    assert _cached(right_guess) == 0


def test_a_custom_router_that_drops_the_salt_still_keeps_tenants_apart(
    custom_stack: dict[str, Service]
) -> None:
    gateway = custom_stack["gateway"]
    _usage(gateway, KEY_A, SECRET)
    assert _cached(_usage(gateway, KEY_A, SECRET)) >= 160  # the custom path reports cache hits
    right_guess = _usage(gateway, KEY_B, SECRET)
    wrong_guess = _usage(gateway, KEY_B, WRONG)
    assert right_guess == wrong_guess, (right_guess, wrong_guess)
    assert _cached(right_guess) == 0


def test_an_explicit_cache_salt_narrows_the_scope_within_a_key(stack: dict[str, Service]) -> None:
    gateway = stack["gateway"]
    prompt = "A shared system prompt that two of tenant A's users both send, word for word. " * 2
    _usage(gateway, KEY_A, prompt, cache_salt="user-1")
    assert _cached(_usage(gateway, KEY_A, prompt, cache_salt="user-1")) > 0
    assert _cached(_usage(gateway, KEY_A, prompt, cache_salt="user-2")) == 0


async def test_pd_usage_reports_transferred_kv_apart_from_cache_hits(stack: dict[str, Service]) -> None:
    prompt = list(range(40, 140))
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=2, cache_salt="grpc-tenant")
    async with create_channel(stack["router"].address, TransportSettings()) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        usages = []
        for attempt in range(2):
            new = router_pb2.NewRequest(request_id=f"pd-usage-{attempt}", sampling=sampling,
                                        token_ids=router_pb2.TokenIds(ids=prompt))
            replies = [m async for m in stub.Generate(iter([router_pb2.GenerateRequest(generate=new)]),
                                                      timeout=60)]
            usages += [m.done.usage for m in replies if m.WhichOneof("event") == "done"]
    first, second = usages
    # P samples the first token (the default): D receives the whole prompt's KV, computing only
    # that token; the second time D's cache (scoped by the salt) holds all but the last page's.
    assert first.cached_tokens == 0 and first.kv_transferred_tokens == len(prompt)
    assert second.cached_tokens >= 96 and second.cached_tokens + second.kv_transferred_tokens == len(prompt)
