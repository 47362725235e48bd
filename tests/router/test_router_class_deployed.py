"""Custom routers outside serve(): `microserving up --router-class` hands the class to
`microserving router`, which loads it (a file path or a module on PYTHONPATH). The MLC
tutorial's CustomRouter gives one engine's tokens on a repeated prompt with the prefix cache
off; an example custom pattern (short prompts stay on the decode engine, long ones go P -> D)
routes as it says, seen from the router's own Generate stream, with one engine's tokens."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import grpc
import httpx
import pytest
from router_stack import REPO, engine_alone, generate, greedy

from microserving.tokenizer import Tokenizer
from microserving.v1 import router_pb2, router_pb2_grpc
from router.router_class import load_router_class

sys.path.insert(0, str(REPO / "tests" / "e2e"))  # e2e_up lives there
from e2e_up import UpStack, start_up  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

TOKENIZER = Tokenizer.from_model("tiny")


@pytest.fixture(scope="module")
def tutorial_stack() -> Iterator[UpStack]:
    stack = start_up("--router-class", f"{REPO}/examples/custom_router.py:CustomRouter",
                     "--enable-prefix-cache", "false")
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def pattern_stack() -> Iterator[UpStack]:
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(REPO / "examples")  # the module spelling of --router-class
    try:
        stack = start_up("--router-class", "short_prompt_router:ShortPromptRouter")
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before
    yield stack
    stack.stop()


async def test_the_tutorial_router_via_router_class_matches_one_engine_on_a_repeated_prompt(
        tutorial_stack: UpStack) -> None:
    assert "--router-class" in tutorial_stack.log()
    prompt = "The tutorial, deployed by up, asked twice over."
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0}
    replies = [httpx.post(f"{tutorial_stack.base_url}/completions", json=body, timeout=120)
               for _ in range(2)]
    decode = tutorial_stack.addresses["decode-1"]
    want = await engine_alone(decode, TOKENIZER.encode(prompt), greedy(10), "alone")
    for reply in replies:
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == TOKENIZER.decode(want)


async def test_an_example_custom_pattern_routes_as_it_says(pattern_stack: UpStack) -> None:
    prefill, decode = pattern_stack.addresses["prefill-0"], pattern_stack.addresses["decode-1"]
    short, long = "Hi there.", "A prompt long enough to be worth moving between the engines."
    async with grpc.aio.insecure_channel(pattern_stack.addresses["router"]) as channel:
        results = await generate(router_pb2_grpc.RouterStub(channel), *(
            router_pb2.NewRequest(request_id=name, text=text, sampling=greedy())
            for name, text in (("short", short), ("long", long))))
    for name, text in (("short", short), ("long", long)):
        got = results[name]
        assert got.error is None and got.done is not None
        assert got.token_ids == await engine_alone(decode, TOKENIZER.encode(text), greedy(), f"alone-{name}")
    assert list(results["short"].done.engines) == [decode]  # type: ignore[union-attr]
    assert set(results["long"].done.engines) == {decode, prefill}  # type: ignore[union-attr]


def test_router_class_specs_are_checked_with_a_reason() -> None:
    custom = load_router_class(f"{REPO}/examples/custom_router.py:CustomRouter")
    assert custom.__name__ == "CustomRouter"
    for spec, words in (("no_colon", "wants"), ("no.such.module:X", "cannot import"),
                        ("router.router:NoSuchClass", "has no"),
                        ("router.settings:RouterSettings", "not a subclass"),
                        ("/nowhere/file.py:X", "no Python file")):
        with pytest.raises(ValueError, match=words):
            load_router_class(spec)
