"""AsyncEngine: the same PD flow through the asyncio API, errors surface as domain errors,
and cancelling or closing a stream frees its request; all of it with the core in a thread and
in a process of its own."""

from __future__ import annotations

import asyncio

import pytest
from engine_test_utils import GREEDY, random_prompt

from engine_shim.engine.api import InvalidRequestError, NotFoundError, SamplingParams
from engine_shim.engine.async_engine import AsyncEngine
from engine_shim.engine.config import EngineConfig

pytestmark = pytest.mark.integration


async def _tokens(stream) -> list[int]:
    return [t async for out in stream for d in out.deltas for t in d.token_ids]


async def _eventually(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


@pytest.fixture(params=[False, True], ids=["thread", "process"])
async def engines(request):
    config = EngineConfig(num_pages=128, kv_export_chunk_tokens=32)
    own_process = request.param
    prefill = AsyncEngine(config, own_process=own_process)
    decode = AsyncEngine(config, own_process=own_process)
    await asyncio.gather(prefill.start(), decode.start())
    yield prefill, decode
    await asyncio.gather(prefill.shutdown(), decode.shutdown())


async def test_async_pd_matches_single_engine(engines) -> None:
    prefill, decode = engines
    ids = random_prompt(1, 100)
    expected = await _tokens(prefill.generate("alone", ids, 0, GREEDY))
    recv = await decode.prep_recv("pd", ids, -1)
    async for chunk in prefill.remote_send("pd", ids, recv.prefix_matched_length, recv.end):
        await decode.import_kv("pd", chunk)
    assert await _tokens(decode.generate("pd", ids, recv.end, GREEDY)) == expected
    await _eventually(lambda: prefill.status().num_free_pages == 128)
    await _eventually(lambda: decode.status().num_free_pages == 128)
    assert decode.tokenizer.vocab_size == decode.vocab_size
    assert decode.kv_layout == prefill.kv_layout


async def test_errors_surface_as_domain_errors_and_the_engine_keeps_serving(engines) -> None:
    _, decode = engines
    with pytest.raises(InvalidRequestError):
        await _tokens(decode.generate("bad", [], 0, GREEDY))
    with pytest.raises(InvalidRequestError):
        await decode.prep_recv("bad", [1, 2, 3], 3)
    with pytest.raises(NotFoundError):
        await decode.import_kv("nobody", object())  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        async for _ in decode.remote_send("bad", [1, 2, 3], 2, 1):
            pass
    assert len(await _tokens(decode.generate("good", [1, 2, 3], 0, GREEDY))) == GREEDY.max_tokens
    assert await decode.abort("good") is False


async def test_cancelling_a_stream_aborts_the_request_and_frees_its_pages(engines) -> None:
    _, decode = engines
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    first_token = asyncio.Event()

    async def consume() -> None:
        async for _ in decode.generate("long", random_prompt(2, 60), 0, long):
            first_token.set()

    task = asyncio.create_task(consume())
    await first_token.wait()
    assert decode.status().num_free_pages < 128
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _eventually(lambda: decode.status().num_free_pages == 128)
    assert decode.status().num_running_requests == 0


async def test_closing_remote_send_early_releases_the_job(engines) -> None:
    prefill, _ = engines
    stream = prefill.remote_send("send", random_prompt(3, 120), 0, 100)
    first = await stream.__anext__()
    assert (first.begin, first.num_tokens) == (0, 32)
    await stream.aclose()
    await _eventually(lambda: prefill.status().num_free_pages == 128)
    assert await prefill.abort("send") is False


async def test_abort_from_outside_ends_the_generate_stream(engines) -> None:
    _, decode = engines
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    outputs = []
    async for out in decode.generate("victim", [5, 6, 7], 0, long):
        outputs.append(out)
        if len(outputs) == 2:
            assert await decode.abort("victim") is True
    assert outputs[-1].is_finished
    assert outputs[-1].deltas[-1].finish_reason.value == "abort"


async def test_export_chunks_by_bytes_hold_as_many_whole_tokens_as_fit() -> None:
    """kv_export_chunk_bytes (what the shim sets to its PushKV message size) sizes chunks by
    the pool's bytes per token, and PD over such chunks stays token-exact."""
    from engine_shim.backends.embedded.kv_plane.codec import bytes_per_token

    decode = AsyncEngine(EngineConfig(num_pages=128))
    await decode.start()
    token_bytes = bytes_per_token(decode.kv_layout)
    prefill = AsyncEngine(EngineConfig(num_pages=128, kv_export_chunk_bytes=3 * token_bytes + 1))
    await prefill.start()
    try:
        ids = random_prompt(2, 40)
        expected = await _tokens(decode.generate("alone", ids, 0, GREEDY))
        recv = await decode.prep_recv("pd", ids, -1)
        sizes = []
        async for chunk in prefill.remote_send("pd", ids, recv.prefix_matched_length, recv.end):
            sizes.append(chunk.num_tokens)
            assert chunk.data.numel() * chunk.data.element_size() == chunk.num_tokens * token_bytes
            await decode.import_kv("pd", chunk)
        assert sum(sizes) == recv.end - recv.prefix_matched_length
        assert set(sizes[:-1]) == {3} and 1 <= sizes[-1] <= 3
        assert await _tokens(decode.generate("pd", ids, recv.end, GREEDY)) == expected
    finally:
        await asyncio.gather(prefill.shutdown(), decode.shutdown())
