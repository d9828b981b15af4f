"""One timer per window instant for every run of a routing process (the drivers' DELTA windows).

With aligned windows ([kafka].coalesce_aligned, events.DeltaCoalescer) every run's window closes at
the same instants, the multiples of coalesce_ms on the host's clock. Each run used to arm a timer of
its own for the instant, and each timer woke its driver's task, which published one DELTA and went
back to sleep: at 64 streams, 64 timers and 64 task wake-ups per instant. Here a window that opens
joins the list of its closing instant, and one timer per instant closes them all:

    pump.take ──opens a window──▶ clock.join(pump, closes_ms) ──▶ _waiting[closes_ms] = [pump, …]
                                   (a timer only for a new instant)        │ its timer fires
                                                                           ▼
    for each pump still waiting for that instant:  pump.window_closed()  ──▶ a publication (an
        awaitable: the driver's DELTA, published for it while its task sleeps) or None (it woke its
        driver instead: its first event, a stop, an ack to wait for, a lease to look at)
    the publications of one instant run in order in ONE task

Windows that are not aligned close at instants of their own: one timer each, as before. A pump leaves
its instant by resetting `window_at` (its window was published sooner, or its attempt ended): the
list is not searched, the tick skips it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Protocol


class Closing(Protocol):
    """What waits for a window's end: a driver's pump."""

    window_at: float | None      # the instant (ms, time.monotonic()) it waits for; None: none

    def window_closed(self) -> Awaitable[None] | None:
        """Its window ended: an awaitable that publishes its DELTA, or None (it handled it itself)."""
        ...


class WindowClock:
    """Closes windows at their instants, one timer per distinct instant. Use on one event loop."""

    __slots__ = ("_loop", "_waiting", "timers_armed")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: dict[float, list[Closing]] = {}   # instant (ms) -> what waits for it, in order
        self.timers_armed = 0

    def join(self, closing: Closing, at_ms: float) -> None:
        """`closing` waits for the instant `at_ms` (ms on time.monotonic()); replaces any instant it
        waited for before."""
        closing.window_at = at_ms
        waiting = self._waiting.get(at_ms)
        if waiting is None:
            waiting = self._waiting[at_ms] = []
            self._arm(at_ms, time.monotonic() * 1000)
        waiting.append(closing)

    def waiting(self, at_ms: float) -> int:
        """How many still wait for `at_ms` (those that left it not counted)."""
        return len({id(closing) for closing in self._waiting.get(at_ms, ()) if closing.window_at == at_ms})

    def _arm(self, at_ms: float, now_ms: float) -> None:
        self.timers_armed += 1
        self._loop.call_later(max(0.0, (at_ms - now_ms) / 1000), self._tick, at_ms)

    def _tick(self, at_ms: float) -> None:
        now_ms = time.monotonic() * 1000
        if now_ms < at_ms:
            # The loop's timers run on a coarser clock (uvloop's: milliseconds): early by a fraction.
            self._arm(at_ms, now_ms)
            return
        publications = []
        for closing in self._waiting.pop(at_ms, ()):
            if closing.window_at != at_ms:
                continue                     # it left this instant
            closing.window_at = None
            publication = closing.window_closed()
            if publication is not None:
                publications.append(publication)
        if publications:
            self._loop.create_task(_in_order(publications))


async def _in_order(publications: list[Awaitable[None]]) -> None:
    """One instant's publications, one after the other (each handles its own failure)."""
    for publication in publications:
        await publication

