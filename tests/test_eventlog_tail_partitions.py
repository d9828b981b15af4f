"""The live tail fetches only the partitions some stream reads (issue 9: a gateway pays for the
records of its own streams' partitions, and nothing while it has no stream), and a stream whose
partition the tail starts following late still gets every event after its cursor. Real Kafka,
on a private two-partition topic so that no other test's records reach it."""

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


async def test_a_partition_no_stream_reads_is_never_fetched_and_a_late_stream_gets_every_event(log):
    read_run, other_run = await run_in(log, 0), await run_in(log, 1)
    reader, other = RunEventSequencer(read_run), RunEventSequencer(other_run)
    read_first = await log.append(reader.status(common_pb2.RUN_STATUS_RUNNING, 0))
    following = asyncio.create_task(read(log, read_run, read_first, 0))
    await until(lambda: log.live_tail is not None and log.live_tail.subscriptions == 1)
    tail = log.live_tail
    assert tail is not None and tail.followed == {0}
    other_first = await log.append(other.status(common_pb2.RUN_STATUS_RUNNING, 0))
    for token in range(4):
        await log.append(other.delta([token], "", 0))
        await log.append(reader.delta([token], "", 0))
    await log.append(reader.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
    assert await following == list(range(1, 7))
    assert tail.received.get(1, 0) == 0           # partition 1's five records never reached the tail
    assert tail.received[0] == 5                  # partition 0's, after the follower's start

    # A stream of partition 1 now: the tail follows it from its end; what came before is replayed.
    late = [asyncio.create_task(read(log, other_run, other_first, after)) for after in (0, 3)]
    await until(lambda: tail.subscriptions == 2)
    assert tail.followed == {0, 1}
    await log.append(other.delta([4], "", 0))
    await log.append(other.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
    assert await late[0] == list(range(1, 8))
    assert await late[1] == list(range(4, 8))
    assert tail.received[1] == 2                  # only the records after it started following


async def test_a_partition_whose_last_stream_ended_is_no_longer_fetched_after_the_linger(log, monkeypatch):
    monkeypatch.setattr(tail_module, "FOLLOW_LINGER_S", 0.3)
    run_id = await run_in(log, 1)
    sequencer = RunEventSequencer(run_id)
    first = await log.append(sequencer.status(common_pb2.RUN_STATUS_RUNNING, 0))
    following = asyncio.create_task(read(log, run_id, first, 0))
    await until(lambda: log.live_tail is not None and log.live_tail.subscriptions == 1)
    await log.append(sequencer.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
    assert await following == [1, 2]
    tail = log.live_tail
    assert tail is not None and tail.followed == {1}
    await until(lambda: tail.followed == frozenset())   # after the linger, at a poll of the tail's loop
    fetched = tail.received[1]
    for _ in range(3):
        await log.append(RunEventSequencer(run_id, 2).delta([0], "", 0))
    await asyncio.sleep(1.0)
    assert tail.received[1] == fetched            # nothing more fetched from it
