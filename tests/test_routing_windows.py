"""The drivers' window clock (services/routing/windows.py): one timer per window instant for every run
of a routing process, and each window's DELTA published while its driver sleeps on."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

import pytest
from sluice.services.routing import driver as driver_module
from sluice.services.routing.windows import WindowClock

from sluice.eventlog.interface import LogPosition
from sluice.v1 import runs_pb2
from tests.test_routing_driver import CountingWake, MemoryLog, Script, ScriptedReplicas, driver_for

DELTA = runs_pb2.EVENT_TYPE_DELTA


@dataclass(eq=False)
class Waiter:
    """A Closing that records when it was closed, and may hand the clock a publication."""

    name: str
    closed: list[str]
    publishes: bool = False
    window_at: float | None = None
    ran: list[str] = field(default_factory=list)

    def window_closed(self) -> Awaitable[None] | None:
        self.closed.append(self.name)
        if not self.publishes:
            return None

        async def publication() -> None:
            self.ran.append(self.name)
            await asyncio.sleep(0)           # a publication that yields keeps its place in the order
            self.ran.append(self.name)
        return publication()


def soon_ms(after_s: float) -> float:
    return time.monotonic() * 1000 + after_s * 1000


def streaming(tokens: int, gap_s: float = 0.02) -> ScriptedReplicas:
    """A replica streaming tokens 1..`tokens`, one per chunk, `gap_s` apart."""
    return ScriptedReplicas({"r0": Script([(t,) for t in range(1, tokens + 1)], gap_s=gap_s)})


def delta_tokens(events: list[runs_pb2.RunEvent]) -> list[list[int]]:
    """Each DELTA's tokens, in publication order."""
    return [list(event.token_ids) for event in events if event.type == DELTA]


def in_order(events: list[runs_pb2.RunEvent]) -> bool:
    return [event.sequence for event in events] == list(range(1, len(events) + 1))


async def test_windows_closing_at_one_instant_share_one_timer_and_close_once_each_in_order():
    clock = WindowClock(asyncio.get_running_loop())
    closed: list[str] = []
    first, second, third, later = (Waiter(name, closed) for name in ("a", "b", "c", "later"))
    instant = soon_ms(0.05)
    for waiter in (first, second, third):
        clock.join(waiter, instant)
    clock.join(later, instant + 50)
    assert clock.timers_armed == 2 and clock.waiting(instant) == 3
    await asyncio.sleep(0.08)
    assert closed == ["a", "b", "c"]
    assert first.window_at is second.window_at is None      # they no longer wait for anything
    await asyncio.sleep(0.05)
    assert closed == ["a", "b", "c", "later"]


async def test_a_window_that_left_its_instant_is_passed_by_and_one_that_rejoined_it_is_closed_once():
    clock = WindowClock(asyncio.get_running_loop())
    closed: list[str] = []
    gone, back = Waiter("gone", closed), Waiter("back", closed)
    instant = soon_ms(0.03)
    clock.join(gone, instant)
    clock.join(back, instant)
    gone.window_at = None                    # published sooner, or its attempt ended
    back.window_at = None
    clock.join(back, instant)                # a new window of the same run, closing at the same instant
    assert clock.timers_armed == 1 and clock.waiting(instant) == 1
    await asyncio.sleep(0.06)
    assert closed == ["back"]


async def test_an_instant_reached_early_by_the_loops_coarser_clock_is_waited_for_again():
    clock = WindowClock(asyncio.get_running_loop())
    closed: list[str] = []
    waiter = Waiter("w", closed)
    instant = soon_ms(0.2)
    clock.join(waiter, instant)
    clock._tick(instant)                     # as a timer firing before the instant would
    assert closed == [] and clock.timers_armed == 2 and waiter.window_at == instant
    await asyncio.sleep(0.25)
    assert closed == ["w"]


async def test_the_publications_of_an_instant_run_one_after_the_other_in_one_task():
    clock = WindowClock(asyncio.get_running_loop())
    closed: list[str] = []
    ran: list[str] = []
    waiters = [Waiter(name, closed, publishes=True, ran=ran) for name in ("a", "b", "c")]
    instant = soon_ms(0.02)
    for waiter in waiters:
        clock.join(waiter, instant)
    tasks_before = len(asyncio.all_tasks())
    await asyncio.sleep(0.03)
    while len(ran) < 6:
        assert len(asyncio.all_tasks()) <= tasks_before + 1, "one task for the instant's publications"
        await asyncio.sleep(0)
    assert closed == ["a", "b", "c"]
    assert ran == ["a", "a", "b", "b", "c", "c"]     # each done before the next begins


# --- with the driver -----------------------------------------------------------------------------


async def test_windows_closed_by_the_clock_are_published_without_waking_the_driver():
    # Twelve tokens 20 ms apart, 50 ms windows: after the first token (published at once, its wake-up),
    # the windows close by time while the replica streams, and the stream's end wakes it once more.
    # Every token is published, each window's tokens in one DELTA, in order.
    log = MemoryLog()
    driver, ledger, _ = driver_for(streaming(12), log, window_ms=50)
    driver._wake = wake = CountingWake()
    await driver.run()
    deltas = delta_tokens(log.events)
    assert sum(deltas, []) == list(range(1, 13)) and in_order(log.events)
    assert deltas[0] == [1] and len(deltas) >= 4, deltas         # several windows closed by time
    assert wake.sets == 2
    assert ledger.finished().output_tokens == 12


async def test_runs_with_aligned_windows_share_one_timer_per_instant():
    clock = WindowClock(asyncio.get_running_loop())
    runs = []
    for _ in range(4):
        driver, ledger, _ = driver_for(streaming(12), window_ms=50)
        driver.settings = dataclasses.replace(driver.settings, coalesce_aligned=True)
        driver.clock = clock
        runs.append((driver, ledger))
    started = time.monotonic()
    await asyncio.gather(*(driver.run() for driver, _ in runs))
    instants = (time.monotonic() - started) * 1000 / 50 + 1
    assert clock.timers_armed <= instants + 2, (clock.timers_armed, instants)   # not four per instant
    for driver, ledger in runs:
        assert sum(delta_tokens(driver.events.events), []) == list(range(1, 13))  # type: ignore[attr-defined]
        assert ledger.finished().output_tokens == 12


async def test_a_window_closing_while_the_run_waits_for_acks_wakes_the_driver_and_order_holds(
        monkeypatch: pytest.MonkeyPatch):
    # Acks 150 ms late and at most two events in flight: most windows close while the driver must wait
    # for the oldest ack first, which only its loop does; the clock wakes it instead of publishing.
    monkeypatch.setattr(driver_module, "MAX_IN_FLIGHT", 2)
    log = MemoryLog(ack_delay_s=0.15)
    driver, ledger, _ = driver_for(streaming(12), log, window_ms=30)
    driver._wake = wake = CountingWake()
    await driver.run()
    assert sum(delta_tokens(log.events), []) == list(range(1, 13)) and in_order(log.events)
    assert wake.sets > 2                     # woken for windows it had to publish itself
    assert ledger.finished().output_tokens == 12


@dataclass
class SlowLog(MemoryLog):
    """A log whose publish takes a while before the event is in it, longer the more tokens it carries
    (as a producer that must first look a partition up): a later, smaller event would overtake."""

    async def publish(self, event: runs_pb2.RunEvent, *,
                      at_once: bool = False) -> asyncio.Future[LogPosition]:
        await asyncio.sleep(0.01 * len(event.token_ids))
        return await super().publish(event, at_once=at_once)


async def test_the_driver_waits_for_the_clocks_publication_of_its_window_before_publishing_itself():
    # The stream ends 5 ms after a window closed by time, while the clock's publication of that
    # window (several tokens: slow) is still on its way; the driver's last DELTA (one token) and the
    # terminal event must still land after it.
    log = SlowLog()
    driver, ledger, _ = driver_for(streaming(8), log, window_ms=50)
    await driver.run()
    assert sum(delta_tokens(log.events), []) == list(range(1, 9)) and in_order(log.events)
    assert ledger.finished().output_tokens == 8


@dataclass
class StallingLog(MemoryLog):
    """Acknowledges the run's first two events (its start), then nothing more."""

    async def publish(self, event: runs_pb2.RunEvent, *,
                      at_once: bool = False) -> asyncio.Future[LogPosition]:
        if event.sequence <= 2:
            return await super().publish(event, at_once=at_once)
        self.events.append(event)
        return asyncio.get_running_loop().create_future()


async def test_a_run_whose_acks_stall_does_not_hold_up_the_windows_of_the_others(
        monkeypatch: pytest.MonkeyPatch):
    # Run A's acks stop after its start: two events in flight later, its next window must wait for
    # room, which its own loop does. The clock publishes every run's window of an instant from one
    # task: had it waited there for A's room, run B (same clock and instants, prompt acks) would stall.
    monkeypatch.setattr(driver_module, "MAX_IN_FLIGHT", 2)
    clock = WindowClock(asyncio.get_running_loop())
    drivers = []
    for log in (StallingLog(), MemoryLog()):
        driver, _, _ = driver_for(streaming(12), log, window_ms=30)
        driver.settings = dataclasses.replace(driver.settings, coalesce_aligned=True)
        driver.clock = clock
        drivers.append(driver)
    stalled = asyncio.create_task(drivers[0].run())
    try:
        await asyncio.wait_for(drivers[1].run(), 5.0)
        assert drivers[1].output_tokens == 12
        assert len(drivers[0].events.events) == 4     # type: ignore[attr-defined]  # then it waits for room
    finally:
        stalled.cancel()


async def test_without_a_window_each_token_wakes_the_driver_and_leaves_at_once():
    # coalesce_ms 0: no window to wait for, no timer armed; every token is its own DELTA.
    log = MemoryLog()
    clock = WindowClock(asyncio.get_running_loop())
    driver, ledger, _ = driver_for(streaming(5), log, window_ms=0)
    driver.clock = clock
    await driver.run()
    assert delta_tokens(log.events) == [[1], [2], [3], [4], [5]] and in_order(log.events)
    assert clock.timers_armed == 0
