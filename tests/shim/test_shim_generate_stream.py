"""Engine.Generate, the multiplexed stream, against a real shim process: many interleaved
requests give exactly StartGenerate's tokens at temperature 0 and share batched messages;
a bad request fails alone with StartGenerate's status code; cancelling one request frees its
KV while the others finish; a broken stream aborts every request on it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from shim_helpers import PROMPT, engine_stub, free_pages, generate, greedy, wait_for_free_pages

from microserving.v1 import common_pb2, engine_pb2

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 12


def _start(request_id: str, tokens: list[int], sampling=None, begin: int = 0) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(start=engine_pb2.StartGenerateRequest(
        request_id=request_id, token_ids=tokens, begin=begin, sampling=sampling or greedy()))


def _cancel(request_id: str) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(cancel=engine_pb2.GenerateCancel(request_id=request_id))


def _prompt(i: int) -> list[int]:
    return [*PROMPT[: 20 + i], 60 + i]


def _bad_starts() -> list[tuple[str, list[int], common_pb2.SamplingParams, int, grpc.StatusCode]]:
    """(request id, token ids, sampling, begin, the code StartGenerate ends with) of bad input."""
    return [
        ("bad-token", [1, 10**7, 3], greedy(), 0, grpc.StatusCode.INVALID_ARGUMENT),  # outside the vocabulary
        ("bad-sampling", _prompt(1), engine_pb2_sampling_with(temperature=-1.0), 0,
         grpc.StatusCode.INVALID_ARGUMENT),
        ("no-prep-recv", _prompt(2), greedy(), 5, grpc.StatusCode.FAILED_PRECONDITION),  # begin > 0, no PrepRecv
    ]


class _Collected:
    """Everything one stream delivered, per request id."""

    def __init__(self) -> None:
        self.token_ids: dict[str, list[int]] = {}
        self.usage: dict[str, engine_pb2.GenerateOutput] = {}
        self.errors: dict[str, engine_pb2.GenerateError] = {}
        self.outputs_per_message: list[int] = []

    def add(self, message: engine_pb2.EngineGenerateResponse) -> None:
        self.outputs_per_message.append(len(message.outputs))
        for output in message.outputs:
            rid = output.request_id
            assert rid not in self.usage and rid not in self.errors, f"output for {rid} after its end"
            ids = self.token_ids.setdefault(rid, [])
            for choice in output.choices:
                ids.extend(choice.token_ids)
            if output.HasField("usage"):
                self.usage[rid] = output
            if output.HasField("error"):
                self.errors[rid] = output.error

    def ended(self, request_ids) -> bool:
        return all(r in self.usage or r in self.errors for r in request_ids)


async def _read_until(call, collected: _Collected, request_ids, timeout_s: float = 120.0) -> None:
    async def read() -> None:
        while not collected.ended(request_ids):
            message = await call.read()
            assert message is not grpc.aio.EOF, "the stream ended early"
            collected.add(message)

    await asyncio.wait_for(read(), timeout_s)


async def test_interleaved_requests_match_start_generate_at_temperature_0(decode_shim) -> None:
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        sampling = [greedy(max_tokens=8 + 3 * i) for i in range(NUM_REQUESTS)]
        want = {}
        for i in range(NUM_REQUESTS):
            want[f"ref-{i}"] = await generate(stub, f"ref-{i}", _prompt(i), sampling=sampling[i])
        call = stub.Generate()
        collected = _Collected()
        ids = [f"mux-{i}" for i in range(NUM_REQUESTS)]
        for i in range(NUM_REQUESTS // 2):  # half now, half while the first half decodes
            await call.write(_start(ids[i], _prompt(i), sampling[i]))
        first = await call.read()
        collected.add(first)
        for i in range(NUM_REQUESTS // 2, NUM_REQUESTS):
            await call.write(_start(ids[i], _prompt(i), sampling[i]))
        await _read_until(call, collected, ids)
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF  # half-closed and all ended: the stream ends
    assert not collected.errors
    for i in range(NUM_REQUESTS):
        assert collected.token_ids[ids[i]] == want[f"ref-{i}"], ids[i]
        assert collected.usage[ids[i]].usage.completion_tokens == len(want[f"ref-{i}"])
    # Outputs of several requests shared messages (one message per engine step, not per request).
    assert max(collected.outputs_per_message) > 1, collected.outputs_per_message
    assert len(collected.outputs_per_message) < sum(len(w) for w in want.values()) / 2


async def test_a_bad_request_fails_alone_with_start_generates_status_code(decode_shim) -> None:
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        baseline = await free_pages(stub)
        call = stub.Generate()
        await call.write(_start("good", _prompt(0), greedy(max_tokens=24)))
        for rid, tokens, sampling, begin, _ in _bad_starts():
            await call.write(_start(rid, tokens, sampling, begin))
        await call.write(_start("twice", _prompt(3), greedy(max_tokens=1500)))
        await call.write(_start("twice", _prompt(3)))  # an id already active on the stream
        collected = _Collected()
        await _read_until(call, collected, ["good", "bad-token", "bad-sampling", "no-prep-recv", "twice"])
        call.cancel()
        assert await wait_for_free_pages(stub, baseline, within_s=2.0) == baseline
    codes = {rid: grpc.StatusCode(_status(e.code)) for rid, e in collected.errors.items()}
    assert codes == {**{rid: code for rid, *_, code in _bad_starts()}, "twice": grpc.StatusCode.ALREADY_EXISTS}
    assert all(e.message for e in collected.errors.values())
    assert len(collected.token_ids["good"]) == 24


async def test_same_codes_as_start_generate(decode_shim) -> None:
    """The codes above are the ones StartGenerate ends with for the same input."""
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        for _, tokens, sampling, begin, code in _bad_starts():
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await generate(stub, "direct-bad", tokens, begin=begin, sampling=sampling)
            assert caught.value.code() == code


async def test_cancelling_one_request_frees_its_pages_while_the_others_finish(decode_shim) -> None:
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        baseline = await free_pages(stub)
        call = stub.Generate()
        await call.write(_start("long", _prompt(3), greedy(max_tokens=1500)))
        others = [f"short-{i}" for i in range(3)]
        for i, rid in enumerate(others):
            await call.write(_start(rid, _prompt(4 + i), greedy(max_tokens=40)))
        collected = _Collected()
        while len(collected.token_ids.get("long", [])) < 3:
            collected.add(await asyncio.wait_for(call.read(), 60))
        assert await free_pages(stub) < baseline  # the long request holds pages
        await call.write(_cancel("long"))
        await _read_until(call, collected, others)
        assert "long" not in collected.usage and "long" not in collected.errors
        assert all(len(collected.token_ids[rid]) == 40 for rid in others)
        # The cancelled request is gone from the engine while the stream stays open.
        assert await wait_for_free_pages(stub, baseline, within_s=2.0) == baseline
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
        assert status.num_running_requests == 0
        # The stream still takes requests.
        await call.write(_start("after", _prompt(0), greedy(max_tokens=4)))
        await _read_until(call, collected, ["after"])
        assert len(collected.token_ids["after"]) == 4
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF


async def test_a_broken_stream_aborts_every_request_on_it(decode_shim) -> None:
    channel, stub = engine_stub(decode_shim.address)
    async with channel:
        baseline = await free_pages(stub)
        call = stub.Generate()
        ids = [f"doomed-{i}" for i in range(4)]
        for i, rid in enumerate(ids):
            await call.write(_start(rid, _prompt(i), greedy(max_tokens=1500)))
        collected = _Collected()
        while not all(len(collected.token_ids.get(rid, [])) >= 2 for rid in ids):
            collected.add(await asyncio.wait_for(call.read(), 60))
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
        assert status.num_running_requests == len(ids)
        call.cancel()  # the caller goes away mid-stream
        assert await wait_for_free_pages(stub, baseline, within_s=2.0) == baseline
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
        assert status.num_running_requests == 0


def engine_pb2_sampling_with(**fields):
    sampling = greedy()
    for name, value in fields.items():
        setattr(sampling, name, value)
    return sampling


def _status(number: int) -> tuple[int, str]:
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code.value
    raise AssertionError(f"unknown status code {number}")
