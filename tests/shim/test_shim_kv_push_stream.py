"""Staged KV pushes on the receiver's KVTransfer.PushKVStream, between real shim processes:
many pushes at once share one stream and each request's tokens match one engine alone (P
logs path=shm-stream); a receiver started with --kv-push-stream false offers no stream and
gets a PushKV call per push; and the receiver's guarantees with the test as the sender on a
raw stream: a push refused, one whose id is taken, one with an empty entry and one given up
(`cancel`) each end alone with their reservations aborted, entries of unknown pushes are
dropped, a good push lands its KV, the stream ends when the sender half-closes after its
pushes, and a stream that breaks aborts the push open on it. A receiver killed and started
again on its address gets P's next push on a new stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from shim_helpers import (
    PROMPT,
    ShimProcess,
    engine_stub,
    free_pages,
    generate,
    generate_alone,
    logged_path,
    pd_flow,
    reserve,
    stage_ones,
    start_shim,
    wait_for_free_pages,
)

from engine_shim.backends.embedded.kv_plane.shm import host_identity
from microserving.transport import TransportSettings, create_channel
from microserving.v1 import engine_pb2, engine_pb2_grpc

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(host_identity() is None, reason="needs memfd and /proc (Linux)"),
]


@pytest.fixture(scope="module")
def stream_shims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ShimProcess]]:
    """A sender on the shared-memory path (the default prefers NIXL where it loads), a
    receiver that offers the stream (the default) and one that does not."""
    tmp = tmp_path_factory.mktemp("push-stream")
    shims = {
        "prefill": start_shim(tmp, "stream-p", "--role", "prefill", "--kv-transport", "shm"),
        "decode": start_shim(tmp, "stream-d", "--role", "decode"),
        "no-stream": start_shim(tmp, "stream-off", "--role", "decode", "--kv-push-stream", "false"),
    }
    yield shims
    for shim in shims.values():
        shim.stop()


async def test_concurrent_pushes_share_the_stream_and_match_one_engine(stream_shims):
    p, d = stream_shims["prefill"], stream_shims["decode"]
    prompts = {f"stream-pd-{i}": [10 + (t * (i + 3)) % 240 for t in range(40 + 7 * i)]
               for i in range(6)}
    expected = {rid: await generate_alone(p.address, f"{rid}-alone", tokens)
                for rid, tokens in prompts.items()}
    d_channel, d_stub = engine_stub(d.address)
    async with d_channel:
        baseline = await free_pages(d_stub)
        flows = await asyncio.gather(*(pd_flow(p.address, d.address, rid, tokens)
                                       for rid, tokens in prompts.items()))
        assert await wait_for_free_pages(d_stub, baseline, within_s=5) == baseline
    for (rid, _), (ids, prep, sent) in zip(prompts.items(), flows, strict=True):
        assert b'"push_stream":true' in prep.kv_addr_info
        assert sent is not None and sent.num_tokens_sent == prep.end - prep.prefix_matched_length
        assert await logged_path(p, rid) == "shm-stream"
        assert ids == expected[rid] and len(ids) == 16


async def test_a_receiver_without_the_stream_gets_a_push_call(stream_shims):
    p, d = stream_shims["prefill"], stream_shims["no-stream"]
    tokens = [t + 150 for t in PROMPT]
    expected = await generate_alone(p.address, "no-stream-alone", tokens)
    ids, prep, _ = await pd_flow(p.address, d.address, "no-stream-pd", tokens)
    assert b'"shm"' in prep.kv_addr_info and b"push_stream" not in prep.kv_addr_info
    assert await logged_path(p, "no-stream-pd") == "shm"  # staged, on a PushKV call
    assert ids == expected


# ---- the receiver's side, with the test as the sender on a raw stream ----


def _entry(push_id: int, **payload: object) -> engine_pb2.PushKVStreamEntry:
    return engine_pb2.PushKVStreamEntry(push_id=push_id, **payload)


def _header(info: dict, token: str | None = None) -> engine_pb2.KVPushHeader:
    return engine_pb2.KVPushHeader(
        request_id=info["request_id"],
        reservation_token=info["reservation_token"] if token is None else token,
        layout=engine_pb2.KVLayout(**info["layout"]),
    )


def _window(begin: int, num_tokens: int) -> engine_pb2.KVChunkData:
    return engine_pb2.KVChunkData(begin=begin, num_tokens=num_tokens)  # its KV is in the stage


class _RawStream:
    """A PushKVStream the test writes entries on and reads results from."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._queue: asyncio.Queue[engine_pb2.PushKVStreamRequest | None] = asyncio.Queue()
        self.call = engine_pb2_grpc.KVTransferStub(channel).PushKVStream(self._requests())
        self.results: dict[int, engine_pb2.PushKVResult] = {}

    async def _requests(self) -> AsyncIterator[engine_pb2.PushKVStreamRequest]:
        while (message := await self._queue.get()) is not None:
            yield message

    def send(self, *entries: engine_pb2.PushKVStreamEntry) -> None:
        self._queue.put_nowait(engine_pb2.PushKVStreamRequest(entries=entries))

    def half_close(self) -> None:
        self._queue.put_nowait(None)

    async def result(self, push_id: int) -> engine_pb2.PushKVResult:
        while push_id not in self.results:
            message = await asyncio.wait_for(self.call.read(), 30)
            assert message is not grpc.aio.EOF, f"the stream ended before push {push_id}'s result"
            for result in message.results:
                assert result.push_id not in self.results, result
                self.results[result.push_id] = result
        return self.results[push_id]


async def test_each_push_on_a_stream_ends_alone_and_the_stream_serves_on(stream_shims):
    d = stream_shims["decode"]
    channel, stub = engine_stub(d.address)
    async with channel, create_channel(d.address, TransportSettings()) as kv_channel:
        baseline = await free_pages(stub)
        stream = _RawStream(kv_channel)
        tokens = {name: [t + offset for t in PROMPT]
                  for name, offset in (("refused", 151), ("taken", 152), ("empty", 153),
                                       ("cancelled", 154), ("landed", 155))}
        reserved = {name: await reserve(stub, f"raw-{name}", ids) for name, ids in tokens.items()}
        for end, info in reserved.values():
            stage_ones(info, end)

        refused = reserved["refused"][1]
        stream.send(_entry(1, header=_header(refused, token="0" * 32)),
                    _entry(9, chunk=_window(0, 4)))  # no push 9: dropped
        taken = reserved["taken"][1]
        stream.send(_entry(2, header=_header(taken)), _entry(2, header=_header(taken)))
        stream.send(_entry(3, header=_header(reserved["empty"][1])), _entry(3))
        stream.send(_entry(4, header=_header(reserved["cancelled"][1])),
                    _entry(4, chunk=_window(0, 8)), _entry(4, cancel=engine_pb2.KVPushCancel()))
        end, landed = reserved["landed"]
        stream.send(_entry(5, header=_header(landed)), _entry(5, chunk=_window(0, 20)),
                    _entry(5, chunk=_window(20, end - 20)), _entry(5, end=engine_pb2.KVPushEnd()))

        codes = {push_id: (await stream.result(push_id)).error.code for push_id in (1, 2, 3)}
        done = await stream.result(5)
        # The KV landed: a start over the window is taken (it would be refused before import).
        generated = await generate(stub, "raw-landed", tokens["landed"], begin=end)
        stream.half_close()  # every push has ended: the stream ends, with nothing for 4 or 9
        assert await asyncio.wait_for(stream.call.read(), 30) is grpc.aio.EOF
        assert await stream.call.code() == grpc.StatusCode.OK
        await stub.Abort(engine_pb2.AbortRequest(request_id="raw-refused"))  # its reservation
        assert await wait_for_free_pages(stub, baseline, within_s=5) == baseline
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
    assert codes == {1: grpc.StatusCode.NOT_FOUND.value[0],
                     2: grpc.StatusCode.ALREADY_EXISTS.value[0],
                     3: grpc.StatusCode.INVALID_ARGUMENT.value[0]}
    assert sorted(stream.results) == [1, 2, 3, 5]
    assert done.WhichOneof("outcome") == "done" and done.done.num_tokens_written == end
    assert len(generated) == 16
    # The taken, empty and cancelled pushes aborted their reservations; none is left.
    assert status.num_reserved_requests == 0


async def test_a_stream_that_breaks_aborts_its_open_push(stream_shims):
    d = stream_shims["decode"]
    channel, stub = engine_stub(d.address)
    async with channel:
        baseline = await free_pages(stub)
        end, info = await reserve(stub, "raw-broken", [t + 156 for t in PROMPT])
        other_end, other = await reserve(stub, "raw-before-break", [t + 157 for t in PROMPT])
        stage_ones(info, end)
        stage_ones(other, other_end)
        async with create_channel(d.address, TransportSettings()) as kv_channel:
            stream = _RawStream(kv_channel)
            stream.send(_entry(1, header=_header(info)), _entry(1, chunk=_window(0, 16)))
            stream.send(_entry(2, header=_header(other)), _entry(2, chunk=_window(0, other_end)),
                        _entry(2, end=engine_pb2.KVPushEnd()))
            # D takes a stream's entries in order: with push 2 done, push 1 is open there.
            assert (await stream.result(2)).WhichOneof("outcome") == "done"
            stream.call.cancel()
        await stub.Abort(engine_pb2.AbortRequest(request_id="raw-before-break"))
        assert await wait_for_free_pages(stub, baseline, within_s=5) == baseline
        status = await stub.GetStatus(engine_pb2.GetStatusRequest())
    assert status.num_reserved_requests == 0


async def test_a_receiver_restarted_on_its_address_gets_pushes_on_a_new_stream(
    stream_shims, tmp_path
):
    """P's stream to D dies with D; D killed and started again on the same port: P's next push
    to it goes on a new stream (not the dead one), token-exact."""
    p = stream_shims["prefill"]
    d = start_shim(tmp_path, "restart-d", "--role", "decode")
    try:
        port = d.address.rsplit(":", 1)[1]
        tokens = [t + 158 for t in PROMPT]
        expected = await generate_alone(p.address, "restart-alone", tokens)
        first, _, _ = await pd_flow(p.address, d.address, "restart-pd-1", tokens)
        d.kill()
        d.process.wait(timeout=30)
        d = start_shim(tmp_path, "restart-d-2", "--role", "decode", "--port", port)
        assert d.address.endswith(f":{port}")
        second, prep, sent = await pd_flow(p.address, d.address, "restart-pd-2", tokens)
    finally:
        d.stop()
    assert await logged_path(p, "restart-pd-1") == "shm-stream"
    assert await logged_path(p, "restart-pd-2") == "shm-stream"
    assert sent is not None and sent.num_tokens_sent == prep.end - prep.prefix_matched_length
    assert first == second == expected
