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


def test_mlc_compat_serves_on_the_loop_its_flag_or_environment_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import engine_shim.mlc_http.cli as mlc_cli

    assert mlc_cli.parse_settings([]).event_loop == "auto"
    assert mlc_cli.parse_settings(["--event-loop", "asyncio"]).event_loop == "asyncio"
    monkeypatch.setenv("MICROSERVING_MLC_COMPAT_EVENT_LOOP", "asyncio")
    assert mlc_cli.parse_settings([]).event_loop == "asyncio"
    monkeypatch.delenv("MICROSERVING_MLC_COMPAT_EVENT_LOOP")
    loops: list[type] = []

    async def serve(settings: object) -> None:  # the server itself is not what this tests
        loops.append(type(asyncio.get_running_loop()))

    monkeypatch.setattr(mlc_cli, "serve", serve)
    assert mlc_cli.main([]) == 0
    assert mlc_cli.main(["--event-loop", "asyncio"]) == 0
    assert loops[0] is uvloop.Loop
    assert loops[1] is not uvloop.Loop
    monkeypatch.setenv("MICROSERVING_MLC_COMPAT_EVENT_LOOP", "trio")
    assert mlc_cli.main([]) == 2  # refused with the settings' message, nothing served
    assert len(loops) == 2
