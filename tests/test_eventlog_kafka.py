"""The Kafka event log against the real broker: exact replay by cursor, the seam between
replay and the live tail, a republished terminal event, locating a run by time."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from sluice.config import load_settings
from sluice.eventlog.events import RunEventSequencer
from sluice.eventlog.interface import LogPosition
from sluice.eventlog.kafka import KafkaEventLog
from sluice.v1 import common_pb2, runs_pb2

pytestmark = pytest.mark.integration

DONE = common_pb2.TokenUsage(output_tokens=1)


@pytest.fixture
async def log() -> AsyncIterator[KafkaEventLog]:
    events = KafkaEventLog.from_config(load_settings())
    await events.start()
    try:
        yield events
    finally:
        await events.close()


async def sequences(log: KafkaEventLog, run_id: str, start: LogPosition, after: int) -> list[int]:
    """The sequences follow() yields; a reader missing an event would wait forever, hence the bound."""
    received: list[int] = []

    async def read() -> None:
        async for event in log.follow(run_id, start, after):
            received.append(event.sequence)

    try:
        await asyncio.wait_for(read(), 10)
    except TimeoutError:
        raise AssertionError(f"follow() stalled after {received}") from None
    return received


async def test_follow_returns_exactly_the_events_after_the_cursor_and_ends_at_the_terminal(log):
    run_id = str(uuid.uuid4())
    seq = RunEventSequencer(run_id)
    first = await log.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
    for token in range(39):
        await log.append(seq.delta([token], "t", 0))
    await log.append(seq.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
    assert await sequences(log, run_id, first, 0) == list(range(1, 42))
    assert await sequences(log, run_id, first, 35) == list(range(36, 42))
    assert await sequences(log, run_id, first, 41) == []


async def test_followers_joining_at_any_moment_of_a_live_run_each_get_every_event_once(log):
    run_id = str(uuid.uuid4())
    seq = RunEventSequencer(run_id)
    first = await log.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
    rng = random.Random(7)

    async def late_follower(delay_s: float) -> list[int]:
        await asyncio.sleep(delay_s)
        return await sequences(log, run_id, first, 0)

    followers = [asyncio.create_task(late_follower(rng.uniform(0, 0.4))) for _ in range(12)]
    for token in range(150):
        await log.append(seq.delta([token], "", 0))
        if token % 5 == 0:
            await asyncio.sleep(0.01)  # let followers subscribe between appends
    await log.append(seq.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
    for received in await asyncio.wait_for(asyncio.gather(*followers), 30):
        assert received == list(range(1, 153))


async def test_a_terminal_event_published_twice_reaches_a_reader_once(log):
    run_id = str(uuid.uuid4())
    seq = RunEventSequencer(run_id)
    first = await log.append(seq.delta([1], "", 0))
    terminal = seq.terminal(common_pb2.RUN_STATUS_INTERRUPTED, DONE, "lost", 0)
    await log.append(terminal)
    await log.append(terminal)
    assert await sequences(log, run_id, first, 0) == [1, 2]
    assert [e.sequence for e in await log.read_durable(run_id, first)] == [1, 2]


async def test_a_run_whose_start_was_never_recorded_is_found_by_time(log):
    run_id = str(uuid.uuid4())
    since_ms = int(time.time() * 1000) - 1000
    seq = RunEventSequencer(run_id)
    first = await log.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
    await log.append(seq.delta([1, 2, 3], "", 0))
    located = await log.locate(run_id, since_ms)
    assert located is not None and located.partition == first.partition and located.offset <= first.offset
    durable = await log.read_durable(run_id, located)
    assert [(e.sequence, e.type) for e in durable] == [(1, runs_pb2.EVENT_TYPE_STATUS),
                                                       (2, runs_pb2.EVENT_TYPE_DELTA)]
    assert await log.locate(run_id, int(time.time() * 1000) + 60_000) is None
