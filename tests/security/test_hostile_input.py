"""Hostile input: every case of the corpus (hostile_corpus.py: bad JSON, wrong types, huge and
negative numbers, NaN / Infinity, empty and enormous prompts, invalid UTF-8, out-of-vocabulary
ids, bad windows, unknown ids, oversized messages, thousands of stop strings, deep JSON) gets
a 4xx with an OpenAI error body over HTTP, or the right gRPC code from the router and the
shim; no message carries a traceback; no engine dies; a good streaming request running
alongside finishes with exactly its reference text; free pages end at baseline."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from hostile_corpus import PROMPT_IDS, cancel_unknown, http_cases, router_cases, shim_cases
from stack_procs import (
    Service,
    engine_status,
    start_gateway,
    start_router,
    start_shims,
    stop_all,
    wait_until,
)

from microserving.transport import TransportSettings, create_channel
from microserving.v1 import engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.e2e

INTERNAL_DETAIL = ("Traceback", 'File "', "Exception", "object at 0x")
GOOD = {"prompt": "a good request", "max_tokens": 120, "ignore_eos": True, "temperature": 0, "stream": True}
CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("hostile")
    prefill, decode = start_shims(logs, ["prefill", "decode"])
    router = start_router(logs, [f"{prefill.address}=prefill", f"{decode.address}=decode"], "--pattern", "disagg")
    gateway = start_gateway(logs, router.address)
    services = {"prefill": prefill, "decode": decode, "router": router, "gateway": gateway}
    yield services
    stop_all(services.values())


async def _stream_text(client: httpx.AsyncClient) -> str:
    text = ""
    async with client.stream("POST", "/v1/completions", json=GOOD) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                text += "".join(c["text"] for c in chunk["choices"])
    return text


def _clean(message: str) -> bool:
    return not any(marker in message for marker in INTERNAL_DETAIL)


async def _http_corpus(client: httpx.AsyncClient, progress: list[tuple[float, str]]) -> list[str]:
    failures = []
    for case in http_cases():
        progress.append((time.monotonic(), f"HTTP {case.name[:60]!r}"))
        reply = await client.request(case.method, case.path, content=case.content, headers=case.headers)
        body = reply.text
        ok = 400 <= reply.status_code < 500 and _clean(body)
        if not case.is_valid_http:
            ok = reply.status_code == 400 and "invalid" in body.lower()
        elif ok and case.method == "POST":
            error = json.loads(body).get("error", {})
            ok = bool(error.get("message")) and bool(error.get("type"))
        if not ok:
            failures.append(f"{case.name}: {reply.status_code} {body[:200]}")
    return failures


async def _generate_codes(stub: router_pb2_grpc.RouterStub, messages: list[router_pb2.GenerateRequest]) -> list[tuple[grpc.StatusCode, str]]:
    """Codes of every RequestError on the stream, plus the call's status when it fails."""

    async def requests():  # type: ignore[no-untyped-def]
        for message in messages:
            yield message

    codes = []
    try:
        async for event in stub.Generate(requests(), timeout=60):
            if event.WhichOneof("event") == "error":
                codes.append((CODE_BY_NUMBER[event.error.code], event.error.message))
    except grpc.aio.AioRpcError as error:
        codes.append((error.code(), error.details() or ""))
    return codes


async def _router_corpus(address: str) -> tuple[list[str], int]:
    failures = []
    async with create_channel(address, TransportSettings()) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        cases = router_cases()
        for case in cases:
            codes = await _generate_codes(stub, case.messages)
            if not codes or any(code not in case.codes or not _clean(msg) for code, msg in codes):
                failures.append(f"{case.name}: {codes}")
        if await _generate_codes(stub, cancel_unknown()):
            failures.append("cancel of an unknown id broke the stream")
        text = b"bad \xff\xfe!"  # NewRequest.text (field 3) holding invalid UTF-8
        new_request = b"\x0a\x01u" + b"\x1a" + bytes([len(text)]) + text
        invalid_utf8 = b"\x0a" + bytes([len(new_request)]) + new_request  # GenerateRequest.generate
        raw = channel.stream_stream("/microserving.v1.Router/Generate", request_serializer=None,
                                    response_deserializer=router_pb2.GenerateResponse.FromString)
        try:
            async for _ in raw(iter([invalid_utf8]), timeout=10):
                pass
            failures.append("invalid UTF-8 in a string field was accepted")
        except grpc.aio.AioRpcError as error:
            if error.code() not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL) or not _clean(error.details() or ""):
                failures.append(f"invalid UTF-8: {error.code()} {error.details()}")
    return failures, len(cases) + 2


async def _shim_call(stub: engine_pb2_grpc.EngineStub, method: str, request: object) -> None:
    call = getattr(stub, method)
    if method == "StartGenerate":
        async for _ in call(request, timeout=30):
            pass
    else:
        await call(request, timeout=30)


async def _push_kv_cases(channel: grpc.aio.Channel) -> list[str]:
    stub = engine_pb2_grpc.KVTransferStub(channel)
    streams = {
        "push_kv no header": [engine_pb2.PushKVRequest(chunk=engine_pb2.KVChunkData(begin=0, num_tokens=1, data=b"x"))],
        "push_kv empty stream": [],
        "push_kv unknown reservation": [engine_pb2.PushKVRequest(header=engine_pb2.KVPushHeader(
            request_id="ghost", reservation_token="guess"))],
    }
    failures = []
    for name, messages in streams.items():
        try:
            await stub.PushKV(iter(messages), timeout=10)
            failures.append(f"{name}: accepted")
        except grpc.aio.AioRpcError as error:
            if error.code() not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                    grpc.StatusCode.FAILED_PRECONDITION) or not _clean(error.details() or ""):
                failures.append(f"{name}: {error.code()} {error.details()}")
    return failures


async def _shim_corpus(address: str) -> tuple[list[str], int]:
    failures = []
    async with create_channel(address, TransportSettings()) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        cases = shim_cases()
        for case in cases:
            try:
                await _shim_call(stub, case.method, case.request)
                failures.append(f"{case.name}: accepted")
            except grpc.aio.AioRpcError as error:
                if error.code() not in case.codes or not _clean(error.details() or ""):
                    failures.append(f"{case.name}: {error.code()} {error.details()}")
        unknown = await stub.Abort(engine_pb2.AbortRequest(request_id="never-seen"), timeout=10)
        if unknown.was_active:
            failures.append("abort of an unknown id claimed it was active")
        held = engine_pb2.PrepRecvRequest(request_id="dup", token_ids=PROMPT_IDS, end=-1)
        await stub.PrepRecv(held, timeout=10)
        try:
            await stub.PrepRecv(held, timeout=10)
            failures.append("duplicate prep_recv accepted")
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.ALREADY_EXISTS:
                failures.append(f"duplicate prep_recv: {error.code()}")
        await stub.Abort(engine_pb2.AbortRequest(request_id="dup"), timeout=10)
        failures += await _push_kv_cases(channel)
    return failures, len(cases) + 5


async def _finish_alongside(good: asyncio.Future[str], progress: list[tuple[float, str]],
                            stack: dict[str, Service]) -> str:
    """The good request's text; when it fails, an error that says what the corpus was doing
    meanwhile and what each service logged (the logs of a CI machine are gone afterwards)."""
    try:
        return await asyncio.wait_for(good, timeout=120)
    except (TimeoutError, httpx.HTTPError, AssertionError) as error:
        began = progress[0][0]
        steps = "\n".join(f"  +{at - began:7.2f} s  {what}" for at, what in progress[-15:])
        logs = "\n".join(f"--- {name} (last 4000 characters)\n{service.log()[-4000:]}"
                         for name, service in stack.items())
        raise AssertionError(f"the good request beside the corpus failed ({error!r}) "
                             f"{time.monotonic() - began:.1f} s after it began; the corpus's last "
                             f"steps:\n{steps}\n{logs}") from error


async def test_hostile_corpus_gets_clear_errors_and_breaks_nothing(stack) -> None:
    engines = [stack["prefill"].address, stack["decode"].address]
    baseline = [(await engine_status(a)).num_free_kv_pages for a in engines]
    async with httpx.AsyncClient(base_url=f"http://{stack['gateway'].address}", timeout=120) as client:
        reference = await _stream_text(client)
        progress = [(time.monotonic(), "the good request")]
        good = asyncio.ensure_future(_stream_text(client))
        http_failures = await _http_corpus(client, progress)
        progress.append((time.monotonic(), "router corpus"))
        router_failures, num_router = await _router_corpus(stack["router"].address)
        shim_failures = []
        num_shim = 0
        for address in engines:
            progress.append((time.monotonic(), f"shim corpus on {address}"))
            failures, num_shim = await _shim_corpus(address)
            shim_failures += failures
        alongside = await _finish_alongside(good, progress, stack)
        after = await _stream_text(client)
    num_cases = len(http_cases()) + num_router + 2 * num_shim
    print(f"\nhostile input: {num_cases} cases ({len(http_cases())} HTTP, {num_router} router gRPC, "
          f"{2 * num_shim} shim gRPC)")
    assert not http_failures, "\n".join(http_failures)
    assert not router_failures, "\n".join(router_failures)
    assert not shim_failures, "\n".join(shim_failures)
    assert num_cases >= 150
    assert alongside == reference and after == reference
    for name, service in stack.items():
        assert service.is_alive(), name
    # The engines free what the last requests held as their aborts and ends arrive, which on
    # a loaded machine can trail the client's last chunk (D once showed 8191 of 8192 pages
    # free here, in the full suite under two busy cores): given until a third of the
    # reservation TTL (30 s), so a reservation nobody ends still fails this.
    async def settled() -> bool:
        found = [await engine_status(a) for a in engines]
        return [s.num_free_kv_pages for s in found] == baseline and not any(
            s.num_reserved_requests for s in found)

    await wait_until(settled, timeout_s=10)
    statuses = [await engine_status(a) for a in engines]
    assert [s.num_free_kv_pages for s in statuses] == baseline
    assert all(s.num_reserved_requests == 0 for s in statuses)
