"""The token relay's coalescing, the protocol models' MLC shape, and the settings layers."""

from __future__ import annotations

import pytest

from microserving.v1 import common_pb2, router_pb2
from router.cli import build_parser
from router.discovery import parse_engine_spec
from router.endpoint import DECODE, PREFILL
from router.microserving_protocol import PrepRecvRequest, RemoteSendRequest, StartGenerateRequest
from router.openai_protocol import CompletionRequest
from router.outbox import Outbox
from router.settings import load_settings


async def test_first_delta_goes_out_alone_and_queued_deltas_merge() -> None:
    outbox = Outbox()
    outbox.put_delta("a", 0, [1], "x")
    first = await outbox.take()
    assert first is not None and [list(r.delta.token_ids) for r in first.responses] == [[1]]
    outbox.put_delta("a", 0, [2], "y")
    outbox.put_delta("a", 0, [3], "z")  # the writer is busy: merges into the queued delta
    outbox.put_delta("b", 0, [7], "q")
    outbox.put_delta("a", 0, [4], "w", finish_reason=common_pb2.FINISH_REASON_STOP)
    outbox.put_delta("a", 0, [5], "late")  # after a finish nothing merges
    outbox.put("b", done=router_pb2.RequestDone())
    batch = await outbox.take()
    assert batch is not None
    merged, other, late, done = batch.responses
    assert list(merged.delta.token_ids) == [2, 3, 4]
    assert merged.delta.text == "yzw" and merged.delta.finish_reason == common_pb2.FINISH_REASON_STOP
    assert other.request_id == "b" and list(other.delta.token_ids) == [7]
    assert late.request_id == "a" and list(late.delta.token_ids) == [5]
    assert done.request_id == "b" and done.HasField("done")
    outbox.close()
    assert await outbox.take() is None


async def test_a_closed_outbox_hands_out_what_is_queued_first() -> None:
    outbox = Outbox()
    outbox.put_delta("a", 0, [1], "x")
    outbox.close()
    batch = await outbox.take()
    assert batch is not None and len(batch.responses) == 1
    assert await outbox.take() is None


def test_microserving_requests_extend_completion_request_like_mlc() -> None:
    base = CompletionRequest(prompt=[1, 2, 3], user="id", max_tokens=4)
    prep = PrepRecvRequest(**base.model_dump(), end=2)
    send = RemoteSendRequest(**base.model_dump(), begin=0, end=2, kv_addr_info="AA==", recv_rank=1)
    start = StartGenerateRequest(**base.model_dump(), begin=2)
    assert (prep.end, send.begin, send.kv_addr_info, send.recv_rank, start.begin) == (2, 0, "AA==", 1, 2)
    assert start.user == "id" and start.max_tokens == 4


def test_engine_spec_roles() -> None:
    assert parse_engine_spec("h:1=prefill").roles == frozenset({PREFILL})
    assert parse_engine_spec("h:1=decode").roles == frozenset({DECODE})
    assert parse_engine_spec("h:1").roles is None
    with pytest.raises(ValueError):
        parse_engine_spec("h:1=sideways")
    with pytest.raises(ValueError):
        parse_engine_spec("nohost")


def test_settings_layers_cli_over_env_over_file(tmp_path, monkeypatch) -> None:
    config = tmp_path / "router.yaml"
    config.write_text("pattern: disagg\nport: 7000\ncache-aware: true\n")
    monkeypatch.setenv("MICROSERVING_ROUTER_PORT", "7100")
    settings = load_settings(str(config))
    assert (settings.pattern, settings.port, settings.cache_aware) == ("disagg", 7100, True)
    args = build_parser().parse_args(["--port", "0", "--engine", "h:1=prefill", "--engine", "h:2"])
    assert args.engines == ["h:1=prefill", "h:2"]
    assert load_settings(str(config), port=0).port == 0


def test_settings_reject_unknown_options_and_bad_values(tmp_path) -> None:
    config = tmp_path / "router.json"
    config.write_text('{"patern": "disagg"}')
    with pytest.raises(ValueError):
        load_settings(str(config))
    with pytest.raises(ValueError):
        load_settings(None, pd_balance_factor=1.5)
