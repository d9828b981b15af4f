"""The event loop a Sluice process runs on: uvloop (the default) or the standard asyncio loop.

uvloop moves the loop's own work (socket readiness, callbacks, timers) from Python into libuv;
it helps the gateway most, whose time goes to many small socket reads and writes (gRPC streams,
Kafka fetches, PostgreSQL round trips). `[gateway].event_loop = "asyncio"` turns it off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")
EVENT_LOOPS = ("uvloop", "asyncio")
UNKNOWN_EVENT_LOOP = "[gateway].event_loop must be one of " + ", ".join(EVENT_LOOPS) + ", got {!r}"


def run(main: Coroutine[Any, Any, T], event_loop: str = "uvloop") -> T:
    """asyncio.run(main) on the named event loop."""
    if event_loop not in EVENT_LOOPS:
        raise ValueError(UNKNOWN_EVENT_LOOP.format(event_loop))
    factory = uvloop.new_event_loop if event_loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
