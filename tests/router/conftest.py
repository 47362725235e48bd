"""Shim processes for the router tests, started once and shared (each test module that needs
engines of its own, e.g. to kill one, starts them itself)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from router_stack import Shim, kill_all, start_shims


@pytest.fixture(scope="session")
def shims() -> Iterator[list[Shim]]:
    """Four embedded tiny shims (role both; the router assigns P/D roles per test)."""
    started = start_shims(["both"] * 4)
    yield started
    kill_all(started)
