"""Aligned coalescing windows ([kafka].coalesce_aligned, issue 9): the routing worker's windows close
on the host's clock at multiples of coalesce_ms, so that every run's DELTAs of a window leave in one
produce request and reach each gateway in one fetch. The configuration reaches the driver, and the
driver's window clock closes a window at its aligned end (its clock: time.monotonic(), the loop's)."""

from __future__ import annotations

import asyncio
import time

from sluice.services.replica_client import TokenChunk
from sluice.services.routing.driver import Wake, _Pump
from sluice.services.routing.worker import WorkerSettings

from sluice.config import load_settings
from sluice.eventlog.events import DeltaCoalescer

WINDOW_MS = 200.0


def test_the_configured_alignment_reaches_the_driver_and_is_on_by_default():
    config = load_settings()
    assert config.kafka.coalesce_aligned
    assert WorkerSettings.from_config(config, "me").driver().coalesce_aligned
    off = config.updated(kafka={"coalesce_aligned": False})
    assert not WorkerSettings.from_config(off, "me").driver().coalesce_aligned


async def test_a_window_opened_mid_way_closes_at_the_next_multiple_of_the_window_on_the_clock():
    loop = asyncio.get_running_loop()
    assert abs(loop.time() - time.monotonic()) < 0.001, "the driver's timers run on the monotonic clock"
    pump = _Pump(DeltaCoalescer(WINDOW_MS, aligned=True), asyncio.Event(), time.monotonic(), cap=100)
    pump.take(TokenChunk((1,), 4, 0))
    assert pump.wake.is_set() and pump.coalescer.take() == [1]   # the first token: published at once
    # The next token opens a window half-way between two multiples of the window: it closes at the
    # next one, ~100 ms on (a window counted from its opening would close ~200 ms on).
    await asyncio.sleep(((WINDOW_MS / 2 + 2 - time.monotonic() * 1000) % WINDOW_MS) / 1000)
    pump.take(TokenChunk((2,), 4, 0))
    closes_ms = (pump.last_token_at * 1000 // WINDOW_MS + 1) * WINDOW_MS   # type: ignore[operator]
    assert pump.window_at == closes_ms
    pump.wake.clear()
    await asyncio.wait_for(pump.wake.wait(), WINDOW_MS / 1000)   # the clock closes it then, not before
    assert time.monotonic() * 1000 >= closes_ms


async def test_a_token_arriving_past_its_windows_instant_before_the_clock_ticks_joins_it_quietly():
    # The loop may read a socket before it runs a timer due as long: a token then arrives after its
    # window's instant. It joins the window, which the clock's tick closes with it; nobody is woken.
    pump = _Pump(DeltaCoalescer(WINDOW_MS, aligned=True), Wake(), time.monotonic(), cap=100)
    pump.take(TokenChunk((1,), 4, 0))
    pump.wake.clear()
    assert pump.coalescer.take() == [1]
    pump.take(TokenChunk((2,), 4, 0))
    instant = pump.window_at
    assert instant is not None and not pump.wake.is_set()
    # The loop busy past the instant (a blocking sleep: no timer runs meanwhile).
    time.sleep(max(0.0, instant / 1000 - time.monotonic()) + 0.005)  # noqa: ASYNC251
    pump.take(TokenChunk((3,), 4, 0))
    assert not pump.wake.is_set() and pump.window_at == instant
    await asyncio.sleep(0.01)                                          # the tick: the driver's turn
    assert pump.wake.is_set() and pump.coalescer.take() == [2, 3]
