"""Fixtures: the gateway under test in front of the FakeRouter test double (port 0)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from gateway_fake_router import FakeRouterServer
from gateway_fixtures import RunningGateway, start_gateway

GatewayFactory = Callable[..., Awaitable[RunningGateway]]


@pytest.fixture
async def fake_router() -> AsyncIterator[FakeRouterServer]:
    router = FakeRouterServer()
    await router.start()
    yield router
    await router.stop()


@pytest.fixture
async def make_gateway(fake_router: FakeRouterServer) -> AsyncIterator[GatewayFactory]:
    started: list[RunningGateway] = []

    async def factory(**overrides: Any) -> RunningGateway:
        gateway = await start_gateway(fake_router, **overrides)
        started.append(gateway)
        return gateway

    yield factory
    for gateway in started:
        await gateway.stop()


@pytest.fixture
async def gateway(make_gateway: GatewayFactory) -> RunningGateway:
    return await make_gateway()
