"""Every failure reaches the client as an OpenAI error body with the right HTTP status, and a
client that goes away cancels its router requests."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import httpx
import pytest
from gateway_fake_router import FakeRouterServer
from gateway_fixtures import RunningGateway, start_gateway
from grpc import aio

from gateway.router_client import RouterClient
from gateway.sse import parse_events
from microserving.transport import TransportSettings
from microserving.v1 import router_pb2

pytestmark = pytest.mark.integration


async def post(gateway: RunningGateway, body: dict[str, Any], path: str = "/completions",
               **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gateway.api_url, timeout=10) as http:
        return await http.post(path, json=body, headers=headers)


def error_of(reply: httpx.Response) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    assert error["message"]
    return error


@pytest.mark.parametrize(("field", "value"), [("temperature", 5), ("n", 0), ("logprobs", 9),
                                               ("max_tokens", 0), ("top_p", 0)])
async def test_out_of_range_field_is_400_naming_the_param(gateway: RunningGateway, field: str,
                                                           value: object) -> None:
    reply = await post(gateway, {"model": "fake", "prompt": "ab", field: value})
    assert reply.status_code == 400
    assert error_of(reply)["param"] == field


async def test_missing_prompt_and_bad_logit_bias_are_400(gateway: RunningGateway) -> None:
    assert (await post(gateway, {"model": "fake"})).status_code == 400
    reply = await post(gateway, {"model": "fake", "prompt": "a", "logit_bias": {"x": 1}})
    assert reply.status_code == 400 and error_of(reply)["param"] == "logit_bias"
    chat = await post(gateway, {"model": "fake", "messages": []}, "/chat/completions")
    assert chat.status_code == 400 and error_of(chat)["param"] == "messages"


async def test_router_invalid_argument_is_400(gateway: RunningGateway) -> None:
    reply = await post(gateway, {"model": "fake", "prompt": "!invalid"})
    assert reply.status_code == 400 and error_of(reply)["type"] == "invalid_request_error"


async def test_api_keys_are_required_when_configured(make_gateway: Any, tmp_path: Any) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\nfrom-file\n")
    gateway = await make_gateway(api_keys=["k1"], api_key_file=key_file)
    body = {"model": "fake", "prompt": "ab"}
    missing = await post(gateway, body)
    assert missing.status_code == 401 and error_of(missing)["code"] == "invalid_api_key"
    wrong = await post(gateway, body, authorization="Bearer nope")
    assert wrong.status_code == 401 and "nope" not in wrong.text
    assert (await post(gateway, body, authorization="Bearer k1")).status_code == 200
    assert (await post(gateway, body, authorization="Bearer from-file")).status_code == 200
    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        assert (await http.get("/health")).status_code == 200  # probes need no key


@pytest.mark.parametrize("stream", [False, True])
async def test_unknown_model_is_404_even_when_streaming(gateway: RunningGateway,
                                                        stream: bool) -> None:
    reply = await post(gateway, {"model": "nope", "prompt": "ab", "stream": stream})
    assert reply.status_code == 404
    assert error_of(reply)["code"] == "model_not_found"
    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        metrics = (await http.get("/metrics")).text
    assert 'microserving_gateway_errors_total{code="model_not_found"} 1.0' in metrics
    assert 'endpoint="/v1/completions",status="404"} 1.0' in metrics


async def test_prompt_over_the_context_length_is_400_context_length_exceeded(gateway: RunningGateway) -> None:
    reply = await post(gateway, {"model": "fake", "prompt": "x" * 100})
    assert reply.status_code == 400
    assert error_of(reply)["code"] == "context_length_exceeded"


async def test_router_overload_is_429_with_retry_after(gateway: RunningGateway) -> None:
    reply = await post(gateway, {"model": "fake", "prompt": "!overloaded"})
    assert reply.status_code == 429 and int(reply.headers["retry-after"]) >= 1
    assert error_of(reply)["type"] == "rate_limit_error"


async def test_admission_limit_is_429_with_retry_after(make_gateway: Any) -> None:
    gateway = await make_gateway(max_inflight=1)
    async with httpx.AsyncClient(base_url=gateway.api_url, timeout=10) as http:
        async with http.stream("POST", "/completions", json={"model": "fake", "prompt": "slow" * 3,
                                                             "stream": True}) as slow:
            assert slow.status_code == 200
            second = await http.post("/completions", json={"model": "fake", "prompt": "ab"})
            assert second.status_code == 429 and second.headers["retry-after"] == "1"
            error_of(second)
        # The slot frees once the gateway has seen the first client hang up.
        async with asyncio.timeout(5):
            while (await http.post("/completions", json={"model": "fake", "prompt": "ab"})
                   ).status_code != 200:
                await asyncio.sleep(0.02)


async def test_router_unavailable_and_router_down_are_503(gateway: RunningGateway) -> None:
    reply = await post(gateway, {"model": "fake", "prompt": "!unavailable"})
    assert reply.status_code == 503 and error_of(reply)["code"] == "service_unavailable"
    await gateway.router.stop()
    down = await post(gateway, {"model": "fake", "prompt": "ab"})
    assert down.status_code == 503
    error_of(down)
    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        assert (await http.get("/health")).status_code == 503
        assert (await http.get("/v1/models")).status_code == 503


async def test_internal_router_error_is_500_without_detail(gateway: RunningGateway) -> None:
    reply = await post(gateway, {"model": "fake", "prompt": "!internal"})
    assert reply.status_code == 500 and "as asked" not in reply.text


async def test_health_follows_the_routers_health_status(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        assert (await http.get("/health")).status_code == 200
        await gateway.router.set_serving(False)
        reply = await http.get("/health")
        assert reply.status_code == 503
        error_of(reply)


async def test_error_after_streaming_started_is_an_sse_error_event(
        gateway: RunningGateway) -> None:
    reply = await post(gateway, {"model": "fake", "prompt": ["ab", "!overloaded"], "stream": True})
    assert reply.status_code == 200
    events = parse_events(reply.content)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "rate_limit_exceeded"


async def wait_until(predicate: Any, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)


async def test_disconnecting_stream_client_cancels_router_request(
        gateway: RunningGateway) -> None:
    servicer = gateway.router.servicer
    body = {"model": "fake", "prompt": "slow" * 10, "stream": True}
    async with httpx.AsyncClient(base_url=gateway.api_url, timeout=10) as http, \
            http.stream("POST", "/completions", json=body) as reply:
        async for _ in reply.aiter_bytes():
            break  # one chunk, then hang up
    await wait_until(lambda: bool(servicer.cancelled))
    assert not servicer.active


async def test_disconnecting_non_stream_client_cancels_router_request(
        gateway: RunningGateway) -> None:
    servicer = gateway.router.servicer
    async with httpx.AsyncClient(base_url=gateway.api_url, timeout=10) as http:
        request = asyncio.ensure_future(
            http.post("/completions", json={"model": "fake", "prompt": "slow" * 10}))
        await wait_until(lambda: bool(servicer.active))
        request.cancel()
    await wait_until(lambda: bool(servicer.cancelled))
    assert not servicer.active


async def test_gateway_reconnects_when_the_router_restarts(fake_router: FakeRouterServer) -> None:
    gateway = await start_gateway(fake_router)
    try:
        assert (await post(gateway, {"model": "fake", "prompt": "ab"})).status_code == 200
        port = fake_router.port
        await fake_router.stop()
        assert (await post(gateway, {"model": "fake", "prompt": "ab"})).status_code == 503
        await fake_router.start(port)
        async with asyncio.timeout(10):
            while (await post(gateway, {"model": "fake", "prompt": "ab"})).status_code != 200:
                await asyncio.sleep(0.1)
    finally:
        await gateway.stop()


async def test_unknown_route_and_wrong_method_get_openai_error_bodies(
        gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        missing = await http.get("/v1/nothing-here")
        wrong = await http.get("/v1/completions")
    assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"
    assert wrong.status_code == 405
    error_of(wrong)


async def test_requests_share_one_router_call_and_a_disconnect_sends_a_cancel(
        gateway: RunningGateway) -> None:
    servicer = gateway.router.servicer
    body = {"model": "fake", "prompt": "slow" * 10, "stream": True}
    async with httpx.AsyncClient(base_url=gateway.api_url, timeout=10) as http:
        async with http.stream("POST", "/completions", json=body) as reply:
            async for _ in reply.aiter_bytes():
                break  # one chunk, then hang up
        replies = await asyncio.gather(*(http.post("/completions", json={
            "model": "fake", "prompt": f"ab{i}"}) for i in range(5)))
    assert [r.json()["choices"][0]["text"] for r in replies] == [f"{i}ba" for i in range(5)]
    await wait_until(lambda: bool(servicer.cancelled))
    assert servicer.cancel_messages == servicer.cancelled  # one cancel, for the one it dropped
    assert servicer.num_generate_calls == 1


async def test_busy_calls_spread_over_more_router_calls_and_idle_ones_are_reused(
        fake_router: FakeRouterServer) -> None:
    client = RouterClient(fake_router.address, TransportSettings(), max_calls=3, requests_per_call=2)
    servicer = fake_router.servicer
    try:
        streams = [client.open_stream() for _ in range(7)]
        for index, stream in enumerate(streams):
            await stream.start([router_pb2.NewRequest(request_id=f"r{index}", model="fake",
                                                      text=f"slowslowslow{index}")])
        # 2 requests per call until the third call, then the least busy call takes the rest
        # (each streams 13 characters 50 ms apart: all still open here).
        assert client.num_generate_calls == 3
        texts = []
        for stream in streams:
            async with stream:
                texts.append("".join([e.delta.text async for e in stream.events()]))
        assert texts == [f"slowslowslow{i}"[::-1] for i in range(7)]
        async with client.open_stream() as later:  # all idle now: no new call
            await later.start([router_pb2.NewRequest(request_id="later", model="fake", text="ab")])
            assert "".join([e.delta.text async for e in later.events()]) == "ba"
        assert client.num_generate_calls == servicer.num_generate_calls == 3
    finally:
        await client.close()


async def test_a_duplicate_router_request_id_fails_only_that_request(
        fake_router: FakeRouterServer) -> None:
    client = RouterClient(fake_router.address, TransportSettings())
    try:
        request = router_pb2.NewRequest(request_id="same", model="fake", text="slow" * 2)
        async with client.open_stream() as first, client.open_stream() as second:
            await first.start([request])
            with pytest.raises(aio.AioRpcError) as raised:
                await second.start([request])
            assert raised.value.code() is grpc.StatusCode.INTERNAL
            events = [e async for e in first.events()]
        assert events[-1].WhichOneof("event") == "done"
        assert "".join(e.delta.text for e in events) == ("slow" * 2)[::-1]
        assert fake_router.servicer.num_generate_calls == 1 and not fake_router.servicer.cancelled
    finally:
        await client.close()


async def test_concurrent_requests_across_a_router_restart_never_hang(
        fake_router: FakeRouterServer) -> None:
    gateway = await start_gateway(fake_router)
    statuses: list[int] = []
    stop = asyncio.Event()

    async def load(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            reply = await http.post("/completions", json={"model": "fake", "prompt": "ab"})
            statuses.append(reply.status_code)
            if reply.status_code != 200:
                await asyncio.sleep(0.01)

    try:
        async with httpx.AsyncClient(base_url=gateway.api_url, timeout=5) as http:
            loaders = [asyncio.ensure_future(load(http)) for _ in range(4)]
            await wait_until(lambda: statuses.count(200) >= 4)
            port = fake_router.port
            await fake_router.stop()
            await wait_until(lambda: 503 in statuses)
            await fake_router.start(port)
            served = len(statuses)
            await wait_until(lambda: statuses[served:].count(200) >= 8, timeout_s=10)
            stop.set()
            await asyncio.gather(*loaders)  # a hung request would raise ReadTimeout here
        assert set(statuses) <= {200, 503}
        assert fake_router.servicer.num_generate_calls >= 1
    finally:
        await gateway.stop()
