"""Disaggregation with the prefill engine sampling the first token (first_token_on_prefill, the
default where both engines serve it): P's RemoteSend (sample_first_token) outputs the first
token of each choice before its KV moves, the router relays it to the client at once, and D
continues from it (StartGenerateRequest.continuations). The client's output -- tokens, text,
finish reasons, usage -- is the one MLC's protocol gives (D sampling every token) and one
engine alone's, for seeded sampling, logprobs and stop strings (n > 1 keeps MLC's protocol:
it cannot resume after streaming); D receives the whole prompt's KV and computes only the
first token; a request that ends with its first token never starts on D and leaves nothing
reserved there."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import grpc
import pytest
from router_stack import (
    Result,
    collect,
    engine_alone,
    engine_status,
    router_settings,
    running_router,
    wait_for,
)

from microserving.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2
from router.router import Router

pytestmark = pytest.mark.integration

_ids = itertools.count()

SAMPLINGS = {
    "greedy": common_pb2.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    "seeded-n2-logprobs": common_pb2.SamplingParams(temperature=0.9, seed=21, n=2, max_tokens=8, ignore_eos=True,
                                                    logprobs=True, top_logprobs=2),
    "penalties": common_pb2.SamplingParams(temperature=0.8, seed=4, frequency_penalty=1.0, max_tokens=10,
                                           ignore_eos=True),
}


class Choices:
    """Per choice, what the client got: tokens, text, logprobs."""

    def __init__(self) -> None:
        self.token_ids: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}
        self.logprobs: dict[int, list[float]] = {}

    def take(self, message: router_pb2.GenerateResponse) -> None:
        if message.WhichOneof("event") != "delta":
            return
        delta = message.delta
        self.token_ids.setdefault(delta.index, []).extend(delta.token_ids)
        self.text[delta.index] = self.text.get(delta.index, "") + delta.text
        self.logprobs.setdefault(delta.index, []).extend(lp.logprob for lp in delta.logprobs)


async def _disagg(shims, sampling: common_pb2.SamplingParams, tokens: list[int], *, on_prefill: bool):
    """One request through a 1P:1D router over shims[0] and shims[1] -> (result, per-choice
    output, the number of first tokens the router took from P)."""
    prefill, decode = shims[0].address, shims[1].address
    router = Router(settings=router_settings([f"{prefill}=prefill", f"{decode}=decode"], pattern="disagg",
                                             first_token_on_prefill=on_prefill))
    async with running_router(router) as (_, stub):
        async def statuses_known() -> bool:
            return all(e.status is not None for e in router.registry.endpoints)

        assert await wait_for(statuses_known)
        request = router_pb2.NewRequest(request_id="r", token_ids=router_pb2.TokenIds(ids=tokens), sampling=sampling)
        result, choices = Result(), Choices()

        async def messages() -> AsyncIterator[router_pb2.GenerateRequest]:
            yield router_pb2.GenerateRequest(generate=request)

        async for message in stub.Generate(messages(), timeout=120):
            collect(result, message)
            choices.take(message)
        sampled_on_p = router.metrics.first_tokens_from_prefill.labels(prefill)._value.get()
    return result, choices, sampled_on_p


def _prompt(length: int) -> list[int]:
    base = next(_ids) * 7919  # a fresh prompt per call: no prefix-cache hit on D skips the send
    return [(base + 31 * i) % 250 + 3 for i in range(length)]


@pytest.mark.parametrize("name", list(SAMPLINGS))
async def test_same_output_as_mlc_protocol_and_one_engine(shims, name: str) -> None:
    sampling = SAMPLINGS[name]
    tokens = _prompt(40)
    got, got_choices, firsts = await _disagg(shims, sampling, tokens, on_prefill=True)
    want, want_choices, firsts_off = await _disagg(shims, sampling, tokens, on_prefill=False)
    assert got.error is None and want.error is None, (got.error, want.error)
    # P sampled only where asked to, and not for n > 1 (which cannot resume after streaming)
    assert (firsts, firsts_off) == (1 if sampling.n <= 1 else 0, 0)
    assert got_choices.token_ids == want_choices.token_ids
    assert got_choices.text == want_choices.text
    for index, logprobs in want_choices.logprobs.items():
        assert got_choices.logprobs[index] == pytest.approx(logprobs, abs=1e-4)
    assert len(got_choices.token_ids) == max(sampling.n, 1)
    assert got.finish == want.finish
    assert got.done is not None and want.done is not None
    assert got.done.usage.completion_tokens == want.done.usage.completion_tokens == max(sampling.n, 1) * sampling.max_tokens
    assert set(got.done.engines) == {shims[0].address, shims[1].address}
    # With P sampling, D receives the whole prompt's KV (PrepRecv's whole_prompt) and computes
    # only the first token; with MLC's protocol, all but the last position (D's prefix cache
    # holds a part of it the second time).
    for result, received in ((got, len(tokens) - (0 if sampling.n <= 1 else 1)), (want, len(tokens) - 1)):
        assert result.done.usage.kv_transferred_tokens + result.done.usage.cached_tokens == received
    if sampling.n <= 1:
        assert got.token_ids == await engine_alone(shims[2].address, tokens, sampling, f"alone-{next(_ids)}")


async def test_stop_string_in_the_first_tokens(shims) -> None:
    """A stop string that the first token completes or that spans the first two: the text
    is cut where MLC's protocol cuts it."""
    tokens = _prompt(30)
    probe, _, _ = await _disagg(shims, SAMPLINGS["greedy"], tokens, on_prefill=False)
    assert probe.error is None and len(probe.text) >= 4
    for stop in (probe.text[:1], probe.text[:3]):
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[stop])
        got, _, _ = await _disagg(shims, sampling, tokens, on_prefill=True)
        want, _, _ = await _disagg(shims, sampling, tokens, on_prefill=False)
        assert got.error is None
        assert (got.text, got.finish) == (want.text, want.finish), stop
        assert got.finish[0] == common_pb2.FINISH_REASON_STOP


async def test_ended_with_the_first_token_never_starts_on_decode(shims) -> None:
    """max_tokens=1: P's first token ends the request; D has no reservation or page left of
    it once the router's cancel reached it."""
    decode = shims[1].address
    sampling = common_pb2.SamplingParams(temperature=0.7, seed=8, max_tokens=1, logprobs=True)
    got, _, firsts = await _disagg(shims, sampling, _prompt(50), on_prefill=True)
    assert got.error is None, got.error
    assert firsts == 1
    assert len(got.token_ids) == 1 and len(got.finish) == 1
    assert got.done is not None and got.done.usage.completion_tokens == 1

    async def nothing_left_on_decode() -> bool:
        status = await engine_status(decode)
        return status.num_reserved_requests == 0 and status.num_free_kv_pages == status.num_total_kv_pages

    assert await wait_for(nothing_left_on_decode)


async def test_unary_remote_send_refuses_sample_first_token(shims) -> None:
    """The first tokens are an output of their own: only on Engine.Generate."""
    async with grpc.aio.insecure_channel(shims[0].address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.RemoteSend(engine_pb2.RemoteSendRequest(
                request_id=f"unary-{next(_ids)}", token_ids=_prompt(10), begin=0, end=-1,
                kv_addr_info=b"x", sampling=SAMPLINGS["greedy"], sample_first_token=True), timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Engine.Generate" in (raised.value.details() or "")
