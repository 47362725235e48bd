"""Where NIXL writes may come, the shim reserves with no TTL in its engine (its ticket owns
the TTL). A PrepRecv given up while its engine call is in flight has no ticket to end the
reservation the engine then makes, so the shim ends it itself once the call completes; an
engine call that fails (nothing reserved, or another request's reservation under the same id)
ends nothing. A start_generate on such a reservation gives it back its engine TTL first, in
the engine's order, so a start the engine refuses still has its pages reclaimed. The engine
is a stand-in: what is tested is the shim's bookkeeping."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine_shim.backends.embedded.backend import EmbeddedBackend
from engine_shim.engine.api import AlreadyExistsError, PrepRecvResult, SamplingParams
from engine_shim.settings import ShimSettings

pytestmark = pytest.mark.unit


class _Engine:
    def __init__(self) -> None:
        self.called = asyncio.Event()
        self.answer: asyncio.Future[PrepRecvResult] = asyncio.get_running_loop().create_future()
        self.held: list[bool] = []
        self.expired: list[str] = []
        self.calls: list[tuple[Any, ...]] = []

    async def prep_recv(self, request_id: str, token_ids: list[int], end: int,
                        sampling: Any, held: bool = False, whole_prompt: bool = False) -> PrepRecvResult:
        self.held.append(held)
        self.called.set()
        return await self.answer

    def submit_expire_reservation(self, request_id: str) -> None:
        self.expired.append(request_id)

    def submit_hold_reservation(self, request_id: str, is_held: bool) -> None:
        self.calls.append(("hold_reservation", request_id, is_held))

    async def generate(self, request_id: str, *args: Any) -> Any:
        self.calls.append(("generate", request_id))
        return
        yield


async def _given_up(answer: PrepRecvResult | BaseException) -> _Engine:
    backend = EmbeddedBackend(ShimSettings(port=0))
    engine = _Engine()
    backend._engine = engine  # type: ignore[assignment]
    backend._nixl = object()  # type: ignore[assignment]  # NIXL writes may come
    call = asyncio.ensure_future(backend.prep_recv("req", [1, 2, 3, 4], -1, SamplingParams()))
    await engine.called.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert engine.expired == []  # the engine has not answered yet
    if isinstance(answer, BaseException):
        engine.answer.set_exception(answer)
    else:
        engine.answer.set_result(answer)
    for _ in range(3):
        await asyncio.sleep(0)  # the shielded call ends, then its callback runs
    assert engine.held == [True]
    return engine


def test_a_reservation_made_for_a_prep_recv_given_up_is_ended() -> None:
    engine = asyncio.run(_given_up(PrepRecvResult("req", 3, 0, (1, 0, 3))))
    assert engine.expired == ["req"]


def test_nothing_is_ended_when_the_engine_reserved_nothing() -> None:
    engine = asyncio.run(_given_up(AlreadyExistsError("request 'req' is already active")))
    assert engine.expired == []


def test_a_start_on_a_held_reservation_gives_the_engine_its_ttl_back_first() -> None:
    async def scenario() -> list[tuple[Any, ...]]:
        backend = EmbeddedBackend(ShimSettings(port=0))
        engine = _Engine()
        backend._engine = engine  # type: ignore[assignment]
        backend._table.open("held", 0, 16, engine_held=True)
        backend._table.open("engine-ttl", 0, 16)
        for request_id in ("held", "engine-ttl", "no-reservation"):
            async for _ in backend.generate(request_id, [1, 2, 3], 0, SamplingParams()):
                pass
        return engine.calls

    assert asyncio.run(scenario()) == [
        ("hold_reservation", "held", False), ("generate", "held"),
        ("generate", "engine-ttl"), ("generate", "no-reservation"),
    ]
