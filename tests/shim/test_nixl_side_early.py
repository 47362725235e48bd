"""The NIXL agent beside the engine core (nixl_core.NixlSide) reads the agent's notifications
between engine steps, and the receiving shim sends the sender its `ready` without waiting
for the core to run the calls before it (the engine's begin_kv_write, then the expect). So a
write can land, and its notification be read after a step, before the core has read its
expect: it is kept until the expect comes, then completed in the engine, never passed on
as if it were complete (that once let a decode start on pages its engine had not marked
written). The agent and the engine are stand-ins: what is tested is the side's bookkeeping."""

from __future__ import annotations

from typing import Any

import pytest

from engine_shim.backends.embedded.kv_plane import nixl_core
from engine_shim.backends.embedded.kv_plane.nixl_core import NixlSide

pytestmark = pytest.mark.unit


class _Agent:
    """What NixlSide asks of its agent here: the notifications read since the last call
    (and none sent on their own, which it would progress for)."""

    is_notifying = False

    def __init__(self) -> None:
        self.incoming: list[tuple[str, bytes]] = []

    def notifications(self) -> list[tuple[str, bytes]]:
        read, self.incoming = self.incoming, []
        return read


class _Core:
    def __init__(self) -> None:
        self.finished: list[str] = []

    def finish_kv_write(self, request_id: str) -> None:
        self.finished.append(request_id)


def _side() -> tuple[NixlSide, _Agent, _Core]:
    agent, core = _Agent(), _Core()
    return NixlSide(core, agent), agent, core  # type: ignore[arg-type]


def test_a_notification_read_before_its_expect_is_kept_then_completed() -> None:
    side, agent, core = _side()
    side.call(nixl_core._EXPECT, (b"other", "writer", "req-other"))  # another write pending
    agent.incoming.append(("writer", b"tag-1"))  # landed before its expect reached the core
    assert side.poll() == []  # not passed on, not completed
    assert core.finished == [] and side.is_busy
    side.call(nixl_core._EXPECT, (b"tag-1", "writer", "req-1"))  # the call the loop reads next
    assert side.poll() == [("notif", "writer", b"tag-1", "")]
    assert core.finished == ["req-1"]
    agent.incoming.append(("writer", b"other"))
    assert side.poll() == [("notif", "writer", b"other", "")]
    assert core.finished == ["req-1", "req-other"] and not side.is_busy


def test_only_the_claimed_agent_completes_a_kept_write() -> None:
    side, agent, core = _side()
    side.call(nixl_core._EXPECT, (b"other", "writer", "req-other"))
    agent.incoming += [("intruder", b"tag-2"), ("writer", b"tag-2")]
    assert side.poll() == []
    side.call(nixl_core._EXPECT, (b"tag-2", "writer", "req-2"))
    events = side.poll()
    assert [e for e in events if e[3] == ""] == [("notif", "writer", b"tag-2", "")]
    assert ("notif", "intruder", b"tag-2", "not the claimed agent's write") in events
    assert core.finished == ["req-2"]


def test_a_kept_notification_nobody_expects_is_dropped_after_its_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side, agent, core = _side()
    now = [100.0]
    monkeypatch.setattr(nixl_core, "time", type("T", (), {"monotonic": staticmethod(lambda: now[0])}))
    side.call(nixl_core._EXPECT, (b"other", "writer", "req-other"))
    agent.incoming.append(("stranger", b"tag-3"))
    assert side.poll() == []
    now[0] += nixl_core._EARLY_KEEP_S + 1
    events: list[Any] = side.poll()
    assert events == [("notif", "stranger", b"tag-3", "no write of this agent was expected")]
    assert core.finished == []
    side.call(nixl_core._FORGET, (b"other",))
    assert not side.is_busy
