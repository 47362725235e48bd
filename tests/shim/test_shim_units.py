"""Pure parts of the shim: MLC window rules and other checks, request-id bookkeeping, the
kv_addr_info format, the error -> status code table, MLC JSON and SSE, token bytes, settings."""

from __future__ import annotations

import base64
import json

import grpc
import numpy as np
import pytest

from engine_shim import validation
from engine_shim.backends.embedded.backend import engine_config
from engine_shim.backends.embedded.kv_plane.addr import KVAddrInfo
from engine_shim.backends.mlc import protocol
from engine_shim.backends.mlc.sse import sse_json
from engine_shim.engine.api import (
    AlreadyExistsError,
    EngineError,
    FailedPreconditionError,
    InvalidRequestError,
    KVLayout,
    NotFoundError,
    RequestAbortedError,
    ResourceExhaustedError,
    SamplingParams,
    UnavailableError,
)
from engine_shim.engine.config import DEFAULT_PREFILL_CHUNK
from engine_shim.errors import status_code_for
from engine_shim.mlc_http.kv_relay import decode_kv_append_metadata, encode_kv_append_metadata
from engine_shim.requests import RequestTracker
from engine_shim.settings import PREFILL_ROLE_CHUNK, ShimSettings
from engine_shim.token_bytes import TokenBytes
from microserving.v1 import engine_pb2

LAYOUT = KVLayout("fp", "float32", 4, 2, 32, 16)


@pytest.mark.parametrize(
    ("end", "n", "expected"), [(-1, 10, 9), (0, 10, 0), (9, 10, 9), (-10, 10, 0)]
)
def test_prep_recv_end_is_normalised_like_mlc(end, n, expected):
    assert validation.prep_recv_end(end, n) == expected


@pytest.mark.parametrize(("end", "n"), [(10, 10), (-11, 10), (11, 10)])
def test_prep_recv_end_outside_the_prompt_is_invalid(end, n):
    with pytest.raises(InvalidRequestError):
        validation.prep_recv_end(end, n)


@pytest.mark.parametrize(("begin", "end"), [(5, 5), (6, 5), (0, 10), (-1, -1), (-11, 3)])
def test_remote_send_needs_begin_before_end_before_len(begin, end):
    with pytest.raises(InvalidRequestError):
        validation.remote_send_window(begin, end, 10)


def test_every_printable_ascii_request_id_is_valid():
    validation.check_request_id("".join(chr(c) for c in range(0x20, 0x7F)))


def test_remote_send_window_accepts_negative_indices():
    assert validation.remote_send_window(-5, -1, 10) == (5, 9)


@pytest.mark.parametrize("request_id", ["", "x" * 257, "tab\there", "é", "del\x7f", "nl\n", "\u2028"])
def test_bad_request_ids_are_invalid(request_id):
    with pytest.raises(InvalidRequestError):
        validation.check_request_id(request_id)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=-0.1),
        SamplingParams(temperature=float("nan")),
        SamplingParams(top_p=0.0),
        SamplingParams(top_p=1.01),
        SamplingParams(top_k=-1),
        SamplingParams(n=0),
        SamplingParams(max_tokens=0),
        SamplingParams(frequency_penalty=2.5),
        SamplingParams(logit_bias={999: 1.0}),
        SamplingParams(logit_bias={1: 101.0}),
        SamplingParams(stop_token_ids=(300,)),
        SamplingParams(stop=("",)),
        SamplingParams(top_logprobs=21),
    ],
)
def test_bad_sampling_values_are_invalid(sampling):
    with pytest.raises(InvalidRequestError):
        validation.check_sampling(sampling, vocab_size=263)


def test_context_check_counts_prompt_and_max_tokens():
    validation.check_context(10, SamplingParams(max_tokens=90), 100)
    with pytest.raises(InvalidRequestError):
        validation.check_context(10, SamplingParams(max_tokens=91), 100)
    with pytest.raises(InvalidRequestError):
        validation.check_context(100, SamplingParams(), 100)


def test_tracker_refuses_duplicates_and_generate_without_reservation():
    now = [0.0]
    tracker = RequestTracker(reservation_ttl_s=5.0, clock=lambda: now[0])
    tracker.begin_prep_recv("a")
    tracker.end_prep_recv("a", end=9)
    with pytest.raises(AlreadyExistsError):
        tracker.begin_prep_recv("a")
    with pytest.raises(FailedPreconditionError):
        tracker.begin_generate("b", begin=3)
    tracker.begin_generate("a", begin=9)
    with pytest.raises(AlreadyExistsError):
        tracker.begin_generate("a", begin=0)
    tracker.end_generate("a")
    assert tracker.num_in_flight == 0


def test_tracker_forgets_expired_reservations():
    now = [0.0]
    tracker = RequestTracker(reservation_ttl_s=5.0, clock=lambda: now[0])
    tracker.begin_prep_recv("a")
    tracker.end_prep_recv("a", end=9)
    now[0] = 6.0
    with pytest.raises(FailedPreconditionError):
        tracker.begin_generate("a", begin=9)


def test_kv_addr_info_round_trips_and_rejects_garbage():
    info = KVAddrInfo("127.0.0.1:1", "r", "t" * 32, 16, 49, (1, 16, 33), LAYOUT)
    assert KVAddrInfo.decode(info.encode()) == info
    for raw in (b"", b"[]", b'{"version": 2}', b'{"version": 1}', b"\xff"):
        with pytest.raises(InvalidRequestError):
            KVAddrInfo.decode(raw)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequestError(), grpc.StatusCode.INVALID_ARGUMENT),
        (AlreadyExistsError(), grpc.StatusCode.ALREADY_EXISTS),
        (NotFoundError(), grpc.StatusCode.NOT_FOUND),
        (FailedPreconditionError(), grpc.StatusCode.FAILED_PRECONDITION),
        (RequestAbortedError(), grpc.StatusCode.FAILED_PRECONDITION),
        (ResourceExhaustedError(), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (UnavailableError(), grpc.StatusCode.UNAVAILABLE),
        (EngineError(), grpc.StatusCode.INTERNAL),
    ],
)
def test_each_domain_error_maps_to_one_status_code(error, code):
    assert status_code_for(error) == code


def test_mlc_body_carries_user_debug_config_and_windows():
    base = protocol.completion_body(
        "m", "req-1", [1, 2, 3], SamplingParams(temperature=0.0, ignore_eos=True, seed=4)
    )
    body = protocol.remote_send_body(base, 0, 2, "abc", 8)
    assert body["user"] == "req-1" and body["debug_config"] == {"ignore_eos": True}
    assert (body["begin"], body["end"], body["kv_addr_info"], body["recv_rank"]) == (0, 2, "abc", 8)
    assert body["prompt"] == [1, 2, 3] and body["seed"] == 4
    assert protocol.completion_body("m", "r", [1], SamplingParams())["debug_config"] == {}
    with pytest.raises(InvalidRequestError):
        protocol.completion_body("m", "r", [1], SamplingParams(top_k=5))


def test_a_calls_ids_become_one_checked_array():
    ids = engine_pb2.RemoteSendRequest(token_ids=[5, 0, 2**31 - 1]).token_ids
    array = validation.token_ids(ids)
    assert isinstance(array, np.ndarray) and array.tolist() == [5, 0, 2**31 - 1]
    validation.check_token_ids(array[:2], vocab_size=6, max_prompt_tokens=2)
    for bad, message in [
        ([], "prompt is empty"), ([1, 2, 3], "limit 2"), ([1, 6], "token id 6 outside"),
        ([-3, 1], "token id -3 outside"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            validation.check_token_ids(validation.token_ids(bad), vocab_size=6, max_prompt_tokens=2)
    for bad in ([1.5], [True], [[1, 2]], ["1"]):
        with pytest.raises(InvalidRequestError, match="must be integers"):
            validation.token_ids(bad)


def test_mlc_body_from_an_array_carries_plain_ints():
    body = protocol.completion_body("m", "r", np.array([7, 8], dtype=np.int32), SamplingParams())
    assert json.loads(json.dumps(body))["prompt"] == [7, 8]


def test_mlc_preempt_maps_to_the_preempt_finish_reason():
    token_bytes = TokenBytes("tiny")
    choice = {
        "index": 0,
        "text": "A",
        "finish_reason": "preempt",
        "logprobs": {"content": [{"token": "A", "logprob": -0.1, "bytes": [65]}]},
    }
    delta = protocol.parse_choice(choice, token_bytes, lambda text: [], want_logprobs=False)
    assert delta.finish_reason is not None and delta.finish_reason.value == "preempt"
    assert delta.token_ids == (65,)


async def test_sse_stops_at_done():
    async def lines():
        for line in [
            b'data: {"a": 1}\n',  # a read ends anywhere: at a line's end,
            b"\n: comment\r\ndata: {",  # across lines and within a line
            b'"a": 2}\n\ndata: [DO',
            b"NE]\n\n",
            b'data: {"a": 3}\n\n',
        ]:
            yield line

    assert [event async for event in sse_json(lines())] == [{"a": 1}, {"a": 2}]


def test_kv_append_metadata_is_base64_json_int_list():
    text = encode_kv_append_metadata([2, 0, 16, 32, 5])
    assert json.loads(base64.b64decode(text)) == [2, 0, 16, 32, 5]
    assert decode_kv_append_metadata(text) == [2, 0, 16, 32, 5]
    with pytest.raises(InvalidRequestError):
        decode_kv_append_metadata(encode_kv_append_metadata([2, 0, 16]))


def test_token_bytes_round_trip_every_byte_token():
    token_bytes = TokenBytes("tiny")
    assert all(token_bytes.to_id(token_bytes.to_bytes(i)) == i for i in range(263))


def test_settings_come_from_the_environment_and_reject_unknown_options(monkeypatch):
    monkeypatch.setenv("MICROSERVING_SHIM_ROLE", "decode")
    monkeypatch.setenv("MICROSERVING_SHIM_PAGE_SIZE", "32")
    settings = ShimSettings()
    assert settings.role == "decode" and settings.page_size == 32
    with pytest.raises(ValueError):
        ShimSettings(no_such_option=1)  # type: ignore[call-arg]


@pytest.mark.parametrize("begin,num_tokens,size", [(0, 0, 0), (5, 256, 1 << 20), (300, 1, 7)])
def test_hand_written_kv_chunk_codec_matches_protobuf_both_ways(begin, num_tokens, size):
    from engine_shim.backends.embedded.kv_plane.codec import (
        decode_chunk_request,
        encode_chunk_request,
    )
    from microserving.v1 import engine_pb2

    raw = bytes(range(256)) * (size // 256) + bytes(size % 256)
    expected = engine_pb2.PushKVRequest(
        chunk=engine_pb2.KVChunkData(begin=begin, num_tokens=num_tokens, data=raw)
    ).SerializeToString()
    assert encode_chunk_request(begin, num_tokens, raw) == expected
    parsed = engine_pb2.PushKVRequest.FromString(encode_chunk_request(begin, num_tokens, raw))
    assert (parsed.chunk.begin, parsed.chunk.num_tokens, parsed.chunk.data) == (begin, num_tokens, raw)
    decoded = decode_chunk_request(expected)  # the copy-free decoder reads protobuf's bytes
    assert decoded is not None
    assert (decoded[0], decoded[1], bytes(decoded[2])) == (begin, num_tokens, raw)
    assert isinstance(decoded[2], memoryview) and decoded[2].obj is expected  # a view, no copy


def test_copy_free_chunk_decoder_takes_any_field_order_and_last_value_wins():
    from engine_shim.backends.embedded.kv_plane.codec import _varint, decode_chunk_request
    from microserving.v1 import engine_pb2

    fields = b"\x1a\x03abc" + b"\x10\x07" + b"\x08" + _varint(300) + b"\x10\x09"
    wire = b"\x12" + _varint(len(fields)) + fields
    parsed = engine_pb2.PushKVRequest.FromString(wire).chunk
    decoded = decode_chunk_request(wire)
    assert decoded is not None
    assert (decoded[0], decoded[1], bytes(decoded[2])) == (parsed.begin, parsed.num_tokens, parsed.data)
    assert decoded[:2] == (300, 9)


@pytest.mark.parametrize(
    "wire",
    [
        b"",
        b"\x0a\x00",  # a header, not a chunk
        b"\x12\x05\x08\x01",  # length runs past the end
        b"\x12\x02\x08\x01\x00",  # trailing bytes after the chunk
        b"\x12\x02\x20\x01",  # unknown field 4
        b"\x12\x0b\x08" + b"\xff" * 9 + b"\x01",  # begin = -1 (ten-byte varint)
        b"\x12\x03\x1a\x05ab",  # data longer than the message
        b"\x12\x01\x08",  # truncated varint
    ],
)
def test_copy_free_chunk_decoder_leaves_everything_else_to_protobuf(wire):
    from engine_shim.backends.embedded.kv_plane.codec import decode_chunk_request

    assert decode_chunk_request(wire) is None


def test_a_prefill_shim_takes_larger_prompt_chunks_by_default():
    """No decode row waits behind a prefill-only engine's steps, so its default chunk is the
    larger one; an explicit setting wins on every role, and reaches the engine's config."""
    assert PREFILL_ROLE_CHUNK > DEFAULT_PREFILL_CHUNK
    assert engine_config(ShimSettings(role="prefill")).prefill_chunk_size == PREFILL_ROLE_CHUNK
    for role in ("decode", "both"):
        assert engine_config(ShimSettings(role=role)).prefill_chunk_size == DEFAULT_PREFILL_CHUNK
    for role in ("prefill", "decode", "both"):
        assert engine_config(ShimSettings(role=role, prefill_chunk_size=96)).prefill_chunk_size == 96
    with pytest.raises(ValueError):
        ShimSettings(prefill_chunk_size=0)
