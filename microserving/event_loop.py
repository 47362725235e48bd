"""The event loop a service runs on: uvloop where it is installed (a dependency off Windows),
unless a service's `event_loop` setting asks for asyncio's own. On the development VM the
router's CPU per relayed token halved on uvloop (docs/router.md, runs 6-8); the shim's
serving work is the same kind (gRPC callbacks, socket reads, thread hand-offs)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")
EventLoop = Literal["auto", "asyncio", "uvloop"]


def loop_runner(event_loop: EventLoop) -> Callable[[Coroutine[Any, Any, T]], T]:
    """asyncio.run, on uvloop for 'uvloop' (an ImportError without it) and for 'auto' when it
    is installed."""
    if event_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                raise
        else:
            return uvloop.run
    return asyncio.run
