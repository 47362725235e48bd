"""Options this server cannot honour are refused with 400 and a message naming the field,
never accepted and ignored; types are strict where OpenAI's are (`true` is not a count,
`1.0` is not max_tokens, `[true]` is not a token list); a float field is checked after its
conversion to the wire's 32-bit float (a top_p of 1e-46 would arrive as 0)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from gateway_fixtures import RunningGateway

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "hi"}]


async def _post(gateway: RunningGateway, body: dict[str, Any], path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gateway.api_url, timeout=10) as http:
        return await http.post(path, json=body)


@pytest.mark.parametrize(("field", "value"), [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "auto"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("functions", [{"name": "f", "parameters": {}}]),
])
async def test_tool_calls_and_structured_output_are_400_naming_the_field(
    gateway: RunningGateway, field: str, value: object
) -> None:
    reply = await _post(gateway, {"model": "fake", "messages": USER, field: value}, "/chat/completions")
    assert reply.status_code == 400, reply.text
    assert f"{field}: not supported" in reply.json()["error"]["message"]


async def test_the_forms_that_ask_for_nothing_are_accepted(gateway: RunningGateway) -> None:
    body = {"model": "fake", "messages": USER, "tool_choice": "none", "response_format": {"type": "text"}}
    reply = await _post(gateway, body, "/chat/completions")
    assert reply.status_code == 200, reply.text


async def test_a_user_message_without_content_is_400(gateway: RunningGateway) -> None:
    reply = await _post(gateway, {"model": "fake", "messages": [{"role": "user"}]}, "/chat/completions")
    assert reply.status_code == 400
    assert "messages.0.content" in reply.json()["error"]["message"]


@pytest.mark.parametrize(("field", "value"), [("n", True), ("max_tokens", 1.0), ("prompt", [True]),
                                               ("prompt", [[1, False]])])
async def test_coercible_values_of_the_wrong_type_are_400(gateway: RunningGateway, field: str,
                                                          value: object) -> None:
    body = {"model": "fake", "prompt": "ab", field: value}
    reply = await _post(gateway, body, "/completions")
    assert reply.status_code == 400, reply.text


async def test_top_p_that_underflows_float32_is_400(gateway: RunningGateway) -> None:
    reply = await _post(gateway, {"model": "fake", "prompt": "ab", "top_p": 1e-46}, "/completions")
    assert reply.status_code == 400
    assert "top_p" in reply.json()["error"]["message"]
    tiny_but_fine = await _post(gateway, {"model": "fake", "prompt": "ab", "top_p": 1e-30}, "/completions")
    assert tiny_but_fine.status_code == 200, tiny_but_fine.text
