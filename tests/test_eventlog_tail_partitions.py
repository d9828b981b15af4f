"""The live tail fetches only while some stream reads (issue 9: a gateway with no stream pays
nothing for the events of others), and a stream that starts it following again gets every event
after its cursor, replayed then live. Real Kafka, on a private two-partition topic so that no
other test's records reach it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from sluice.config import load_settings
from sluice.eventlog import tail as tail_module
from sluice.eventlog.events import RunEventSequencer
from sluice.eventlog.interface import LogPosition
from sluice.eventlog.kafka import KafkaEventLog
from sluice.v1 import common_pb2

pytestmark = pytest.mark.integration

DONE = common_pb2.TokenUsage(output_tokens=1)
PARTITIONS = 2


@pytest.fixture
async def log() -> AsyncIterator[KafkaEventLog]:
    bootstrap = load_settings().kafka.bootstrap
    topic = f"sluice.test-tail-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)])
        events = KafkaEventLog(bootstrap, topic)
        await events.start()
        try:
            yield events
        finally:
            await events.close()
            await admin.delete_topics([topic])
    finally:
        await admin.close()


async def run_in(log: KafkaEventLog, partition: int) -> str:
    """A run id whose events the producer sends to `partition`."""
    while True:
        run_id = str(uuid.uuid4())
        if await log.partition_of(run_id) == partition:
            return run_id


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def read(log: KafkaEventLog, run_id: str, start: LogPosition, after: int) -> list[int]:
    async def sequences() -> list[int]:
        return [event.sequence async for event in log.follow(run_id, start, after)]
    return await asyncio.wait_for(sequences(), 15)


async def test_a_process_with_no_stream_fetches_nothing_and_a_later_stream_gets_every_event_after_its_cursor(
        log):
    early_run, late_run = await run_in(log, 0), await run_in(log, 1)
    early, late = RunEventSequencer(early_run), RunEventSequencer(late_run)
    tail, _ = await log._ready_tail(early_run)          # started, as after a stream long gone
    assert tail.followed == frozenset()
    late_first = await log.append(late.status(common_pb2.RUN_STATUS_RUNNING, 0))
    for token in range(3):
        await log.append(late.delta([token], "", 0))
    await asyncio.sleep(1.0)                             # several of the tail's polls
    assert tail.received == {}                           # nothing fetched: no stream wanted it

    early_first = await log.append(early.status(common_pb2.RUN_STATUS_RUNNING, 0))
    following = [asyncio.create_task(read(log, early_run, early_first, 0)),
                 asyncio.create_task(read(log, late_run, late_first, 0)),
                 asyncio.create_task(read(log, late_run, late_first, 3))]
    await until(lambda: tail.subscriptions == 3)
    assert tail.followed == {0, 1}                       # every partition, from its end
    await log.append(late.delta([3], "", 0))
    await log.append(early.delta([0], "", 0))
    await log.append(late.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
    await log.append(early.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
    assert await following[0] == [1, 2, 3]
    assert await following[1] == [1, 2, 3, 4, 5, 6]     # 1-4 replayed, 5-6 live
    assert await following[2] == [4, 5, 6]
    assert tail.received == {0: 2, 1: 2}                 # only what was written after it followed


async def test_the_tail_stops_fetching_once_no_stream_was_left_for_the_linger(log, monkeypatch):
    monkeypatch.setattr(tail_module, "FOLLOW_LINGER_S", 0.3)
    run_id = await run_in(log, 1)
    sequencer = RunEventSequencer(run_id)
    first = await log.append(sequencer.status(common_pb2.RUN_STATUS_RUNNING, 0))
    following = asyncio.create_task(read(log, run_id, first, 0))
    await until(lambda: log.live_tail is not None and log.live_tail.subscriptions == 1)
    await log.append(sequencer.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
    assert await following == [1, 2]
    tail = log.live_tail
    assert tail is not None
    await until(lambda: tail.followed == frozenset())   # after the linger, at a poll of the tail's loop
    fetched = dict(tail.received)
    for _ in range(3):
        await log.append(RunEventSequencer(run_id, 2).delta([0], "", 0))
    await asyncio.sleep(1.0)
    assert tail.received == fetched                      # nothing more fetched
