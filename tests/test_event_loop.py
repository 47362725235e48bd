"""The event loop each service runs on: uvloop where installed unless asked otherwise, and a
clear refusal of a loop that does not exist."""

from __future__ import annotations

import asyncio

import pytest
import uvloop
from pydantic import ValidationError

from engine_shim.cli import main as shim_main
from engine_shim.cli import parse_settings
from microserving.event_loop import loop_runner


def test_auto_and_uvloop_run_on_uvloop_asyncio_on_asyncio() -> None:
    assert loop_runner("auto") is uvloop.run
    assert loop_runner("uvloop") is uvloop.run
    assert loop_runner("asyncio") is asyncio.run


def test_the_loop_runs_the_coroutine_on_the_loop_asked_for() -> None:
    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    assert loop_runner("auto")(loop_type()) is uvloop.Loop
    assert loop_runner("asyncio")(loop_type()) is not uvloop.Loop


def test_the_shim_takes_its_event_loop_from_the_flag_or_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_settings([]).event_loop == "auto"
    assert parse_settings(["--event-loop", "asyncio"]).event_loop == "asyncio"
    monkeypatch.setenv("MICROSERVING_SHIM_EVENT_LOOP", "uvloop")
    assert parse_settings([]).event_loop == "uvloop"
    with pytest.raises(ValidationError, match="event_loop"):
        parse_settings(["--event-loop", "trio"])


def test_the_shim_refuses_an_unknown_loop_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert shim_main(["--event-loop", "trio"]) == 2
    assert "event_loop" in capsys.readouterr().err
