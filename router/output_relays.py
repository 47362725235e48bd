"""The three ways an attempt's output reaches the request's output (request_output.py), one
set of rules: with the built-in patterns the engine's ChoiceDelta protos go to the client as
they are, fed by the engine's multiplexed stream (`relay_streamed`) or by a StartGenerate
call (`relay_messages`); a custom translate_request's CompletionResponse chunks are
converted choice by choice (`relay_completions`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

from router.engine_calls import Messages
from router.openai_protocol import CompletionResponse
from router.request_output import AttemptOutcome, RequestOutput
from router.resumed_text import ResumedText
from router.streamed_decode import StreamedDecode

T = TypeVar("T")


async def relay_messages(messages: Messages, output: RequestOutput,
                         resumed: ResumedText | None) -> AttemptOutcome:
    """The built-in patterns' StartGenerate messages (engine_stream off)."""
    return await _relay(messages, functools.partial(output.take, resumed=resumed))


async def relay_streamed(decode: StreamedDecode[AttemptOutcome], output: RequestOutput,
                         resumed: ResumedText | None) -> AttemptOutcome:
    """The built-in patterns' decode on the engine's multiplexed stream: the stream's
    reader hands each output of this request to `output.take` directly (no task switch per
    message); this task wakes once, when the request ends."""
    outcome = await decode.run(functools.partial(output.take, resumed=resumed))
    return AttemptOutcome.DONE if outcome is None else outcome


async def relay_completions(generator: AsyncGenerator[CompletionResponse | None, None],
                            output: RequestOutput, resumed: ResumedText | None) -> AttemptOutcome:
    """A custom translate_request's CompletionResponse chunks."""
    return await _relay(generator, functools.partial(output.take_completion, resumed=resumed))


async def _relay(items: AsyncGenerator[T, None],
                 take: Callable[[T], AttemptOutcome | None]) -> AttemptOutcome:
    """Each item to `take` until one ends the attempt or the generator does; closed either way
    (closing a StartGenerate call's generator cancels the call)."""
    async with contextlib.aclosing(items):
        async for item in items:
            outcome = take(item)
            if outcome is not None:
                return outcome
    return AttemptOutcome.DONE
