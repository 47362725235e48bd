"""End to end: the stack `microserving up` starts (tiny model, 1 prefill + 1 decode shim,
disagg router, gateway), driven with the official openai client like any OpenAI server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import httpx
import openai
import psutil
import pytest
from e2e_up import UpStack, start_up

from microserving.v1 import engine_pb2, engine_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

API_KEY = "e2e-key"
MAX_INFLIGHT = 3


@pytest.fixture(scope="module")
def stack() -> Iterator[UpStack]:
    running = start_up("--api-key", API_KEY, "--max-inflight", str(MAX_INFLIGHT))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(stack: UpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_stream_joined_equals_non_stream_at_temperature_0(client: openai.OpenAI,
                                                          model: str) -> None:
    kwargs = {"model": model, "prompt": "The capital of France is", "max_tokens": 24,
              "temperature": 0}
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    joined = "".join(c.choices[0].text for c in chunks if c.choices)
    assert joined == whole.choices[0].text and whole.usage.completion_tokens > 0
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]


def test_n_2_streams_exactly_one_finish_reason_per_choice(client: openai.OpenAI,
                                                          model: str) -> None:
    stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                       n=2, temperature=0.8, seed=1, stream=True)
    reasons: dict[int, list[str]] = {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                reasons[choice.index].append(choice.finish_reason)
    assert all(len(r) == 1 for r in reasons.values()), reasons


def test_usage_streams_only_with_include_usage_and_always_without_stream(
        client: openai.OpenAI, model: str) -> None:
    plain = list(client.completions.create(model=model, prompt="Hi", max_tokens=4, stream=True))
    assert all(c.usage is None for c in plain)
    chunks = list(client.completions.create(model=model, prompt="Hi", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens > 0
    whole = client.completions.create(model=model, prompt="Hi", max_tokens=4)
    assert whole.usage is not None
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_n_2_returns_two_choices(client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=6, n=2,
                                      temperature=0)
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert reply.choices[0].text == reply.choices[1].text  # greedy choices agree


def test_stop_string_ends_the_choice_without_the_stop_text(client: openai.OpenAI,
                                                           model: str) -> None:
    kwargs = {"model": model, "prompt": "abc", "max_tokens": 24, "temperature": 0}
    free = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    assert len(free) >= 4
    stop = free[2:4]
    cut = client.completions.create(stop=[stop], **kwargs).choices[0]  # type: ignore[call-overload]
    assert cut.finish_reason == "stop"
    assert cut.text == free[:free.index(stop)]


def test_logprobs_cover_every_generated_token(client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0,
                                      logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens or []) == reply.usage.completion_tokens
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs or [])
    assert all(len(top) <= 2 for top in logprobs.top_logprobs or [] if top)


def test_chat_completion_stream_and_non_stream_agree(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    whole = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                 max_tokens=10, temperature=0, stream=True))
    joined = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert joined == whole.choices[0].message.content


def test_seed_reproduces_a_sampled_output(client: openai.OpenAI, model: str) -> None:
    kwargs = {"model": model, "prompt": "Random:", "max_tokens": 16, "temperature": 1.0,
              "seed": 1234}
    first = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    again = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    assert first == again


def engine_statuses(stack: UpStack) -> list[engine_pb2.GetStatusResponse]:
    statuses = []
    for address in stack.engine_addresses():
        with grpc.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            statuses.append(stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=5))
    return statuses


def is_idle_at(statuses: list[engine_pb2.GetStatusResponse], baseline: list[int]) -> bool:
    return [s.num_free_kv_pages for s in statuses] == baseline and not any(
        s.num_running_requests or s.num_waiting_requests or s.num_reserved_requests
        for s in statuses)


def test_disconnecting_client_stops_engine_work(stack: UpStack, client: openai.OpenAI,
                                                model: str) -> None:
    baseline = [s.num_free_kv_pages for s in engine_statuses(stack)]
    max_tokens = int((client.models.list().data[0].model_extra or {}).get("max_model_len", 2048))
    max_tokens -= 64
    body = {"model": model, "prompt": "Tell me a long story", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=stack.base_url, timeout=60) as http, \
            http.stream("POST", "/completions", json=body, headers=headers) as reply:
        assert reply.status_code == 200
        started_s, num_chunks = time.monotonic(), 0
        for _ in reply.iter_lines():
            num_chunks += 1
            if time.monotonic() - started_s > 1.0 and num_chunks > 2:
                # Asked while still reading: leaving the loop closes the response (httpx),
                # which is the disconnect itself, so asking after it would race the abort.
                assert not is_idle_at(engine_statuses(stack), baseline), "engines should be busy"
                break
        rate = num_chunks / (time.monotonic() - started_s)  # SSE lines (~2 per token) per s
    hung_up_s = time.monotonic()
    # Running on, the request would need about this long; cancelled, it must stop well before.
    remaining_s = max(2.0 * (max_tokens - num_chunks) / rate, 3.0)
    while time.monotonic() - hung_up_s < remaining_s / 2:
        statuses = engine_statuses(stack)
        if is_idle_at(statuses, baseline):
            return
        time.sleep(0.1)
    pytest.fail(f"engines still busy {remaining_s / 2:.1f} s after the client left: {statuses}")


@pytest.fixture(scope="module")
def tokens_per_s(client: openai.OpenAI, model: str) -> float:
    """This stack's generation rate for one request, first token included."""
    started_s = time.monotonic()
    reply = client.completions.create(model=model, prompt="Rate", max_tokens=200,
                                      extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == 200
    return 200 / (time.monotonic() - started_s)


def test_disconnecting_non_streaming_client_stops_engine_work(stack: UpStack, model: str,
                                                              tokens_per_s: float) -> None:
    baseline = [s.num_free_kv_pages for s in engine_statuses(stack)]
    body = {"model": model, "prompt": "Tell me another long story", "max_tokens": 1900,
            "ignore_eos": True}

    async def start_and_hang_up() -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60,
                                     headers=headers) as http:
            request = asyncio.ensure_future(http.post("/completions", json=body))
            async with asyncio.timeout(30):
                while is_idle_at(engine_statuses(stack), baseline):
                    await asyncio.sleep(0.05)
            request.cancel()  # closes the connection mid-request

    asyncio.run(start_and_hang_up())
    hung_up_s = time.monotonic()
    # Running on, the request would need about this long; cancelled, it must stop well before.
    bound_s = max(0.5 * body["max_tokens"] / tokens_per_s, 1.0)  # type: ignore[operator]
    while time.monotonic() - hung_up_s < bound_s:
        if is_idle_at(engine_statuses(stack), baseline):
            return
        time.sleep(0.05)
    pytest.fail(f"engines still busy {bound_s:.1f} s after a non-streaming client left")


def assert_openai_error(error: openai.APIStatusError, status: int) -> dict[str, object]:
    assert error.status_code == status
    body = error.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def test_out_of_range_field_is_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt="x", temperature=5)
    assert assert_openai_error(caught.value, 400)["param"] == "temperature"


def test_bad_api_key_is_401(stack: UpStack, model: str) -> None:
    wrong = openai.OpenAI(base_url=stack.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.completions.create(model=model, prompt="x", max_tokens=1)
    assert_openai_error(caught.value, 401)


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert_openai_error(caught.value, 404)


def test_prompt_longer_than_the_context_is_400_context_length_exceeded(client: openai.OpenAI, model: str) -> None:
    context = client.models.list().data[0].model_extra or {}
    length = int(context.get("max_model_len") or 4096)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt="x" * (length + 16), max_tokens=1)
    error = assert_openai_error(caught.value, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "maximum context length" in error["message"]


def test_over_the_inflight_limit_is_429_with_retry_after(stack: UpStack, model: str) -> None:
    async def run() -> httpx.Response:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"model": model, "prompt": "Go", "max_tokens": 300, "ignore_eos": True,
                "stream": True}
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60,
                                     headers=headers) as http:
            streams = [http.stream("POST", "/completions", json=body) for _ in range(MAX_INFLIGHT)]
            opened = [await s.__aenter__() for s in streams]
            try:
                assert all(r.status_code == 200 for r in opened)
                return await http.post("/completions", json={**body, "stream": False})
            finally:
                for s in streams:
                    await s.__aexit__(None, None, None)

    reply = asyncio.run(run())
    assert reply.status_code == 429 and int(reply.headers["retry-after"]) >= 1
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_gateway_without_a_reachable_router_is_503(stack: UpStack) -> None:
    """A second gateway, pointed at a port nobody serves: /health and requests are 503."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "microserving.cli", "gateway", "--router",
                                f"127.0.0.1:{dead_port}", "--port", "0"],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        address = process.stdout.readline().split("listening on ")[1].split()[0]
        with httpx.Client(base_url=f"http://{address}", timeout=30) as http:
            assert http.get("/health").status_code == 503
            reply = http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == "service_unavailable"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_sigterm_stops_every_service_with_no_orphans(stack: UpStack) -> None:
    assert set(stack.pids) >= {"prefill-0", "decode-1", "router", "gateway"}
    assert stack.stop() == 0
    alive = [name for name, pid in stack.pids.items()
             if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
