"""`microserving shim --backend synthetic` (benchmark only) as real processes: its stream is what
the schedule says (token count, finish reasons, n), and the disaggregated flow runs through
the real KV data plane between two synthetic shims, giving the tokens one shim gives alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from shim_helpers import ShimProcess, engine_stub, free_pages, generate, greedy, pd_flow

from microserving.v1 import common_pb2, engine_pb2

pytestmark = pytest.mark.e2e

PROMPT = [ord(c) for c in "a prompt of plain words for the synthetic engine "]


def _start(tmp_path: Path, name: str, role: str) -> ShimProcess:
    args = ["shim", "--backend", "synthetic", "--model", "tiny", "--port", "0", "--role", role,
            "--synthetic-step-ms", "1:0.5,64:1.0"]
    return ShimProcess(args, tmp_path / f"{name}.log")


@pytest.fixture(scope="module")
def synthetic_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("synthetic")
    prefill = _start(tmp, "prefill", "prefill")
    decode = _start(tmp, "decode", "decode")
    yield prefill.address, decode.address
    prefill.stop()
    decode.stop()


async def _stream(address: str, request_id: str, sampling: common_pb2.SamplingParams
                  ) -> list[engine_pb2.GenerateOutput]:
    channel, stub = engine_stub(address)
    async with channel:
        request = engine_pb2.StartGenerateRequest(request_id=request_id, token_ids=PROMPT,
                                                  sampling=sampling)
        return [response async for response in stub.StartGenerate(request)]


def test_stream_carries_max_tokens_then_length(synthetic_pair: tuple[str, str]) -> None:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=2)
    responses = asyncio.run(_stream(synthetic_pair[1], "stream", sampling))
    for index in (0, 1):
        choices = [c for r in responses for c in r.choices if c.index == index]
        assert sum(len(c.token_ids) for c in choices) == 40
        assert len("".join(c.text for c in choices)) == 40  # one printable byte per token
        finishes = [c.finish_reason for c in choices if c.finish_reason]
        assert finishes == [common_pb2.FINISH_REASON_LENGTH]
    assert responses[-1].usage.completion_tokens == 80


def test_disaggregated_flow_through_the_data_plane(synthetic_pair: tuple[str, str]) -> None:
    prefill, decode = synthetic_pair

    async def both() -> tuple[list[int], list[int], engine_pb2.RemoteSendResponse | None, int]:
        channel, stub = engine_stub(decode)
        async with channel:
            baseline = await free_pages(stub)
            alone = await generate(stub, "alone", PROMPT, sampling=greedy(24))
            ids, _, sent = await pd_flow(prefill, decode, "pd", PROMPT)
            return alone, ids, sent, baseline - await free_pages(stub)

    alone, ids, sent, pages_kept = asyncio.run(both())
    assert ids[:16] == alone[:16] and len(ids) == 16  # pd_flow asks greedy(): 16 tokens
    assert sent is not None and sent.num_tokens_sent == len(PROMPT) - 1
    assert sent.num_bytes_sent == 8 * (len(PROMPT) - 1)  # the synthetic layout: 8 B a token
    assert pages_kept == 0


def test_unmodelled_sampling_is_invalid_argument(synthetic_pair: tuple[str, str]) -> None:
    sampling = common_pb2.SamplingParams(max_tokens=4, presence_penalty=1.0)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        asyncio.run(_stream(synthetic_pair[1], "penalty", sampling))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "synthetic" in (caught.value.details() or "")
