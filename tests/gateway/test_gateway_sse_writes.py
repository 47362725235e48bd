"""How a streamed response reaches the server: the ASGI messages the gateway's app sends for one
request (each body message is one socket write and one chunk of the chunked encoding). The
stream's tail (what comes once the router has finished: the last events, the usage chunk,
`[DONE]`) goes with the body's end in one message, chat's role chunk with the first events;
and a client that leaves ends the stream at once, its router request cancelled."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from gateway_fixtures import RunningGateway

from gateway.serving.disconnect import FinalChunk, RelayResponse
from gateway.sse import DONE_EVENT, parse_events

pytestmark = pytest.mark.integration


async def _messages(gateway: RunningGateway, path: str, body: dict[str, Any],
                    receive_after_body: Any = None) -> list[dict[str, Any]]:
    """The ASGI messages the app (started by the gateway's uvicorn) sends for one request."""
    app = gateway.server.config.loaded_app
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}
    is_sent = False
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal is_sent
        if not is_sent:
            is_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if receive_after_body is not None:
            return await receive_after_body()
        await never.wait()  # the client stays
        raise AssertionError("unreachable")

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    return sent


def _bodies(messages: list[dict[str, Any]]) -> list[bytes]:
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    assert all(m["type"] == "http.response.body" for m in messages[1:])
    return [m["body"] for m in messages[1:]]


async def test_a_completion_stream_ends_in_one_message(gateway: RunningGateway) -> None:
    messages = await _messages(gateway, "/v1/completions", {
        "model": "fake", "prompt": "hello", "stream": True,
        "stream_options": {"include_usage": True}})
    bodies = _bodies(messages)
    assert [m.get("more_body", False) for m in messages[1:]] == [True] * (len(bodies) - 1) + [False]
    assert all(bodies), "no empty body message (the end goes with the last bytes)"
    last = parse_events(bodies[-1])
    assert last[-1] == "[DONE]" and bodies[-1].endswith(DONE_EVENT)
    assert last[-2]["usage"]["completion_tokens"] == 5  # the usage chunk went with it
    events = parse_events(b"".join(bodies))
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "olleh"
    assert [e["choices"][0]["finish_reason"] for e in events[:-2]][-1] == "stop"


async def test_chat_sends_its_role_chunk_with_the_first_events(gateway: RunningGateway) -> None:
    messages = await _messages(gateway, "/v1/chat/completions", {
        "model": "fake", "messages": [{"role": "user", "content": "abc"}], "stream": True})
    bodies = _bodies(messages)
    first = parse_events(bodies[0])
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(first) >= 2 and first[1]["choices"][0]["delta"]["content"] == "c"
    assert bodies[-1].endswith(DONE_EVENT) and messages[-1]["more_body"] is False
    events = parse_events(b"".join(bodies))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "cba"


async def test_a_client_that_leaves_ends_the_stream_and_cancels(gateway: RunningGateway) -> None:
    leave = asyncio.Event()

    async def receive_after_body() -> dict[str, Any]:
        await leave.wait()
        return {"type": "http.disconnect"}

    async def leave_soon() -> None:
        await asyncio.sleep(0.3)  # the "slow" prompt makes a token every 50 ms
        leave.set()

    leaving = asyncio.ensure_future(leave_soon())
    messages = await _messages(gateway, "/v1/completions", {
        "model": "fake", "prompt": "slow" + "x" * 60, "stream": True}, receive_after_body)
    await leaving
    bodies = _bodies(messages)
    text = "".join(e["choices"][0]["text"] for e in parse_events(b"".join(bodies))[:-1])
    assert 0 < len(text) < 64, "stopped well before the end"
    await asyncio.wait_for(_until_no_active(gateway), timeout=10)


async def _until_no_active(gateway: RunningGateway) -> None:
    while gateway.router.servicer.active:
        await asyncio.sleep(0.02)


async def test_relay_response_without_a_final_chunk_ends_with_an_empty_body() -> None:
    closed: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    response = RelayResponse(chunks(), on_close=lambda: closed.append(1), media_type="text/plain")
    await response({"type": "http"}, receive, send)
    assert [(m.get("body"), m.get("more_body")) for m in sent[1:]] == [
        (b"a", True), (b"b", True), (b"", False)]
    assert closed == [1]
    assert isinstance(FinalChunk(b"x"), bytes)
