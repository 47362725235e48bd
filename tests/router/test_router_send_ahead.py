"""Disagg's RemoteSend goes out with D's PrepRecv where P takes the receiver's address later
(send_ahead, the default): P's message (kv_addr_follows, no address) is on P's stream before
D's PrepRecv has answered, D's address follows in a send_to once it has, and the tokens are
one engine's alone; with the setting off the calls stay in turn. Against real shims."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from router_stack import disagg_matches_one_engine

from microserving.v1 import engine_pb2
from router.engines import EngineStream

_ids = itertools.count()


@pytest.mark.parametrize("send_ahead", [True, False])
async def test_disagg_makes_the_send_with_the_receivers_prep_recv(shims, monkeypatch, send_ahead: bool) -> None:
    events: list[str] = []
    real_call, real_send_to = EngineStream.call, EngineStream.send_to

    async def call(self: EngineStream, request_id: str, message: engine_pb2.EngineGenerateRequest,
                   timeout_s: float | None, on_first: Any = None) -> Any:
        action = message.WhichOneof("action")
        if action == "remote_send":
            send = message.remote_send
            events.append(f"remote_send made follows={send.kv_addr_follows} address={bool(send.kv_addr_info)}")
        else:
            events.append(f"{action} made")
        reply = await real_call(self, request_id, message, timeout_s, on_first)
        events.append(f"{action} returned")
        return reply

    def send_to(self: EngineStream, target: engine_pb2.RemoteSendTarget) -> None:
        events.append(f"send_to address={bool(target.kv_addr_info)}")
        real_send_to(self, target)

    monkeypatch.setattr(EngineStream, "call", call)
    monkeypatch.setattr(EngineStream, "send_to", send_to)
    await disagg_matches_one_engine(shims, [*range(50, 110), 9 + next(_ids)], send_ahead=send_ahead)
    if send_ahead:
        assert events == ["prep_recv made", "remote_send made follows=True address=False", "prep_recv returned",
                          "send_to address=True", "remote_send returned"]
    else:
        assert events == ["prep_recv made", "prep_recv returned", "remote_send made follows=False address=True",
                          "remote_send returned"]
