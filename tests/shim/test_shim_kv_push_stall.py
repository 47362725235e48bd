"""A KV push over gRPC (the fallback where neither NIXL nor the shared-memory stage serves a
peer, and a push through the stage, whose windows go on the receiver's PushKVStream) to a
receiver that stops taking it: the sender ends the RemoteSend with UNAVAILABLE naming the
receiver within its stall bound (--kv-push-stall-timeout-s), as a NIXL write does within
--kv-write-timeout-s, rather than holding it until the push's whole deadline (300 s, queueing
included) or the caller's; its pages come back. The receiver is a real shim stopped with
SIGSTOP: alive, its socket open, reading nothing."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from shim_helpers import (
    PROMPT,
    ShimProcess,
    engine_stub,
    free_pages,
    greedy,
    introduce,
    start_shim,
    wait_for_free_pages,
)

from microserving.transport import FAULT_METADATA_KEY, FAULT_RECEIVER
from microserving.v1 import engine_pb2

pytestmark = pytest.mark.e2e

STALL_S = 1.0
# Without the bound the send would wait out this deadline (DEADLINE_EXCEEDED): long enough
# that a loaded machine's stall detection (a second and a few checks) never comes near it.
CALLER_DEADLINE_S = 20.0


@pytest.fixture(scope="module", params=["grpc", "shm"])
def grpc_shims(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ShimProcess]]:
    """P and D on the gRPC KV path, or on the shared-memory stage (the push's windows on D's
    PushKVStream)."""
    transport = request.param
    tmp_path = tmp_path_factory.mktemp(f"push-stall-{transport}")
    shims = {
        "prefill": start_shim(tmp_path, "stall-p", "--role", "prefill", "--kv-transport", transport,
                              "--kv-push-stall-timeout-s", str(STALL_S)),
        "decode": start_shim(tmp_path, "stall-d", "--role", "decode", "--kv-transport", transport),
    }
    yield shims
    decode = shims["decode"].process
    if decode.poll() is None:
        os.kill(decode.pid, signal.SIGCONT)
    for shim in shims.values():
        shim.stop()


async def test_a_push_to_a_stopped_receiver_ends_unavailable_within_its_stall_bound(grpc_shims):
    p, d = grpc_shims["prefill"], grpc_shims["decode"]
    d_channel, d_stub = engine_stub(d.address)
    p_channel, p_stub = engine_stub(p.address)
    async with d_channel, p_channel:
        await introduce(p_stub, d.address)  # a shim pushes KV to known peers only
        baseline = await free_pages(p_stub)
        tokens = [t + 140 for t in PROMPT]
        prep = await d_stub.PrepRecv(engine_pb2.PrepRecvRequest(
            request_id="stalled-push", token_ids=tokens, end=-1, sampling=greedy()))
        assert b'"nixl"' not in prep.kv_addr_info
        assert (b'"shm"' in prep.kv_addr_info) == ("shm" in p.log_path.parent.name)
        os.kill(d.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await p_stub.RemoteSend(engine_pb2.RemoteSendRequest(
                    request_id="stalled-push", token_ids=tokens, begin=0, end=prep.end,
                    kv_addr_info=prep.kv_addr_info, sampling=greedy()), timeout=CALLER_DEADLINE_S)
            elapsed = time.monotonic() - started
        finally:
            os.kill(d.process.pid, signal.SIGCONT)
        # The sender's pages (its send's own) come back.
        assert await wait_for_free_pages(p_stub, baseline, within_s=10) == baseline
        await d_stub.Abort(engine_pb2.AbortRequest(request_id="stalled-push"))
    error = failed.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE, (error.code(), error.details(), elapsed)
    assert "took nothing" in (error.details() or "")
    # The sender names the receiver, so a router takes it out of rotation, not this engine.
    assert dict(error.trailing_metadata() or ()).get(FAULT_METADATA_KEY) == FAULT_RECEIVER
    assert STALL_S <= elapsed < CALLER_DEADLINE_S / 2, elapsed


async def test_a_push_to_a_live_receiver_is_not_cut_by_the_bound(grpc_shims):
    """The bound counts only the receiver's time: the same shims carry a PD send whole."""
    p, d = grpc_shims["prefill"], grpc_shims["decode"]
    d_channel, d_stub = engine_stub(d.address)
    p_channel, p_stub = engine_stub(p.address)
    async with d_channel, p_channel:
        await introduce(p_stub, d.address)
        tokens = [t + 141 for t in PROMPT]
        prep = await d_stub.PrepRecv(engine_pb2.PrepRecvRequest(
            request_id="live-push", token_ids=tokens, end=-1, sampling=greedy()))
        sent = await p_stub.RemoteSend(engine_pb2.RemoteSendRequest(
            request_id="live-push", token_ids=tokens, begin=0, end=prep.end,
            kv_addr_info=prep.kv_addr_info, sampling=greedy()), timeout=CALLER_DEADLINE_S)
        await d_stub.Abort(engine_pb2.AbortRequest(request_id="live-push"))
    assert sent.num_tokens_sent == prep.end - prep.prefix_matched_length and sent.num_bytes_sent > 0
