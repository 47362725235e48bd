"""The shim's stream interval on Engine.Generate (`--stream-interval-ms`): after a request's
first output, messages go at most once per interval, so several engine steps' tokens share a
message (each step's ChoiceDelta kept, in order); the first output never waits, and the tokens
are exactly StartGenerate's. A real shim process with a long interval, so merging is certain
however loaded the machine is (no timing is asserted)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
from shim_helpers import PROMPT, ShimProcess, engine_stub, generate, greedy, start_shim, until_none

from engine_shim.engine.api import Delta, FinishReason, GenerateOutput, Usage
from engine_shim.multiplex import GenerateMultiplexer
from microserving.v1 import engine_pb2

pytestmark = pytest.mark.e2e

INTERVAL_MS = 400
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def interval_shim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShimProcess]:
    shim = start_shim(tmp_path_factory.mktemp("interval"), "interval", "--role", "both",
                      "--stream-interval-ms", str(INTERVAL_MS))
    yield shim
    shim.stop()


async def test_outputs_after_the_first_share_messages_and_keep_every_token(interval_shim) -> None:
    channel, stub = engine_stub(interval_shim.address)
    async with channel:
        expected = await generate(stub, "alone", PROMPT, sampling=greedy(MAX_TOKENS))
        start = engine_pb2.StartGenerateRequest(request_id="r", token_ids=PROMPT,
                                                sampling=greedy(MAX_TOKENS))
        requests: asyncio.Queue[engine_pb2.EngineGenerateRequest | None] = asyncio.Queue()
        await requests.put(engine_pb2.EngineGenerateRequest(start=start))

        call = stub.Generate(until_none(requests))
        tokens: list[int] = []
        steps_per_message: list[int] = []
        async for message in call:
            (output,) = message.outputs
            steps_per_message.append(len(output.choices))
            for choice in output.choices:
                tokens.extend(choice.token_ids)
            if output.HasField("usage"):
                await requests.put(None)
    assert tokens == expected
    # The first token went out as soon as the writer was free, not held for the interval:
    # later messages merged what the engine stepped during theirs.
    assert len(steps_per_message) < MAX_TOKENS
    assert steps_per_message[0] < max(steps_per_message[1:])


async def test_a_request_s_last_output_is_not_held_by_the_interval() -> None:
    """The multiplexer alone, its request run by the test: with an interval of an hour, the
    first output goes out at once, the next ones wait, and the last one (the request's end, for
    which its caller waits) goes out at once with the waiting ones merged before it. Were the
    last output held like the others, the second message would come an hour later."""
    on_output: list[Callable[[GenerateOutput], None]] = []
    release = asyncio.Event()

    async def run(start: engine_pb2.StartGenerateRequest, emit: Callable[[GenerateOutput], None]) -> None:
        on_output.append(emit)
        await release.wait()

    multiplexer = GenerateMultiplexer(run, stream_interval_s=3600.0)
    incoming: asyncio.Queue[engine_pb2.EngineGenerateRequest | None] = asyncio.Queue()
    messages = multiplexer.serve(until_none(incoming))
    first = asyncio.ensure_future(anext(messages))
    await incoming.put(engine_pb2.EngineGenerateRequest(
        start=engine_pb2.StartGenerateRequest(request_id="r", token_ids=PROMPT)))
    while not on_output:
        await asyncio.sleep(0.01)
    emit = on_output[0]
    emit(GenerateOutput("r", (Delta(0, (5,), "a"),)))
    received = [await asyncio.wait_for(first, 60)]
    emit(GenerateOutput("r", (Delta(0, (6,), "b"),)))
    emit(GenerateOutput("r", (Delta(0, (7,), "c", finish_reason=FinishReason.STOP),),
                        usage=Usage(prompt_tokens=len(PROMPT), completion_tokens=3)))
    received.append(await asyncio.wait_for(anext(messages), 60))
    release.set()
    await incoming.put(None)
    assert [[list(c.token_ids) for o in m.outputs for c in o.choices] for m in received] == [[[5]], [[6], [7]]]
    assert received[1].outputs[0].HasField("usage")
    await messages.aclose()
