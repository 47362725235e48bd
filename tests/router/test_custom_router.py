"""The MLC tutorial's CustomRouter (examples/custom_router.py) runs on our router and gives
the tokens one engine gives alone; the runner resumes a preempted request without repeating
text."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from router_stack import REPO, engine_alone, generate, greedy, router_settings, running_router

from microserving.tokenizer import Tokenizer
from microserving.v1 import router_pb2
from router import Router
from router import microserving_protocol as microserving_entrypoints
from router import openai_protocol as openai_api_protocol

pytestmark = pytest.mark.integration


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("custom_router", REPO / "examples" / "custom_router.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_tutorial_custom_router_gives_single_engine_tokens(shims) -> None:
    custom_router = _load_example().CustomRouter
    prefill, decode = shims[0], shims[1]
    host_p, port_p = prefill.address.rsplit(":", 1)
    host_d, port_d = decode.address.rsplit(":", 1)
    # MLC's constructor signature: engine 0 prefills, engine 1 decodes.
    router = custom_router("tiny", None, [host_p, host_d], [int(port_p), int(port_d)], [1, 1], False, "disagg", 0.0)
    prompts = ["The tutorial router moves KV from P to D.", "Another prompt, a bit longer than the first one is."]
    async with running_router(router) as (_, stub):
        results = await generate(stub, *(
            router_pb2.NewRequest(request_id=str(i), text=p, sampling=greedy()) for i, p in enumerate(prompts)
        ))
    tokenizer = Tokenizer.from_model("tiny")
    for i, prompt in enumerate(prompts):
        want = await engine_alone(shims[2].address, tokenizer.encode(prompt), greedy(), f"tutorial-{i}")
        got = results[str(i)]
        assert got.error is None and got.token_ids == want
        assert list(got.done.engines) == [decode.address, prefill.address]


class PreemptOnceRouter(Router):
    """Data parallel, but the first attempt reports a preempt after three tokens (as an engine
    under KV pressure does), so the runner must resume from prompt + streamed tokens."""

    num_attempts = 0

    async def translate_request(
        self, request: openai_api_protocol.CompletionRequest, request_id: str
    ) -> AsyncGenerator[openai_api_protocol.CompletionResponse | None, Any]:
        type(self).num_attempts += 1
        first_attempt = type(self).num_attempts == 1
        start = microserving_entrypoints.StartGenerateRequest(**request.model_dump(), begin=0)
        num_tokens = 0
        async for response in self.send_start_generate(None, start, self.server_urls[0]):
            if first_attempt and num_tokens >= 3:
                yield None
                return
            num_tokens += sum(len(c.token_ids or ()) for c in response.choices)
            yield response


async def test_preempted_request_resumes_without_duplicated_text(shims) -> None:
    prompt = "Resume me after a preempt, please."
    router = PreemptOnceRouter(settings=router_settings([f"{shims[0].address}=both"], pattern="round-robin"))
    async with running_router(router) as (_, stub):
        results = await generate(stub, router_pb2.NewRequest(request_id="p", text=prompt, sampling=greedy(max_tokens=10)))
    tokenizer = Tokenizer.from_model("tiny")
    want = await engine_alone(shims[1].address, tokenizer.encode(prompt), greedy(max_tokens=10), "preempt-alone")
    got = results["p"]
    assert PreemptOnceRouter.num_attempts == 2
    assert got.error is None and got.token_ids == want
    assert got.done.usage.completion_tokens == len(want)
    assert got.done.usage.prompt_tokens == len(tokenizer.encode(prompt))
