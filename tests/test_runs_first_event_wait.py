"""How a Stream waits for its run's start in the ledger (services/runs.py _wait_for_events), without
servers: the ledger read and the event log are stand-ins. A NOTIFY that the run's first event is
durable (or about to be: RUNNING commits while it travels) hurries the live tail; a run RUNNING
without a recorded start is re-read after START_POLL_S, doubling, not after WAIT_REPOLL_S."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from sluice.ledger.runs_sql import EventStart
from sluice.services import runs as runs_module
from sluice.services.runs import RunsService, StreamStart

from sluice.eventlog.interface import LogPosition

RUN = uuid.UUID(int=7)
RECORDED = EventStart(0, 42, None, started=True)


class HurriedLog:
    def __init__(self) -> None:
        self.hurried = 0

    def hurry(self) -> None:
        self.hurried += 1


def service_reading(*reads: EventStart) -> tuple[RunsService, HurriedLog, list[float]]:
    """A RunsService whose ledger reads return `reads` in turn (the last one again after), with no
    listener (so it polls); the loop times of the reads."""
    log = HurriedLog()
    service = RunsService(None, log, 3.0, hot=object())  # type: ignore[arg-type]
    at: list[float] = []
    answers = list(reads)

    async def event_start(run_id: uuid.UUID) -> EventStart:
        at.append(asyncio.get_running_loop().time())
        return answers.pop(0) if len(answers) > 1 else answers[0]

    service._event_start = event_start  # type: ignore[method-assign]
    return service, log, at


async def test_a_notified_start_hurries_the_live_tail_once_then_reads_the_ledger():
    service, log, _ = service_reading(RECORDED)
    notified = asyncio.Event()
    notified.set()
    assert await service._wait_for_events(RUN, 0, notified, 5.0) == StreamStart(LogPosition(0, 42))
    assert log.hurried == 1


async def test_no_notify_within_the_wait_hurries_nothing():
    service, log, _ = service_reading(RECORDED)
    assert await service._wait_for_events(RUN, 0, asyncio.Event(), 0.05) == StreamStart(LogPosition(0, 42))
    assert log.hurried == 0


async def test_a_run_running_without_its_start_is_read_again_soon_and_sooner_than_the_repoll(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(runs_module, "WAIT_REPOLL_S", 60.0)
    pending = EventStart(None, None, None, started=True)
    service, _, at = service_reading(pending, pending, pending, RECORDED)
    found = await asyncio.wait_for(service._wait_for_events(RUN, 0), 5.0)
    assert found == StreamStart(LogPosition(0, 42))
    gaps = [later - earlier for earlier, later in zip(at, at[1:], strict=False)]
    poll = runs_module.START_POLL_S
    assert len(gaps) == 3
    assert all(gap >= wait * 0.9 for gap, wait in zip(gaps, (poll, 2 * poll, 4 * poll), strict=True))
    assert sum(gaps) < 3.0                               # not WAIT_REPOLL_S / 10 (6 s) a read
