"""Two gateways, each placing the runs it admits on its own home partitions (issue 9: each gateway
read every event of every partition): each one's live tail fetches its own runs' events and not the
other's, and a stream of the other gateway's run still gets every event after its cursor, replayed
and live, that partition being followed only while such a stream lasts. Real Kafka, on a private
four-partition topic; a third event log publishes, as the routing worker does."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.partitioner import DefaultPartitioner

from sluice.config import load_settings
from sluice.eventlog import kafka as kafka_module
from sluice.eventlog import tail as tail_module
from sluice.eventlog.events import RunEventSequencer
from sluice.eventlog.interface import LogPosition
from sluice.eventlog.kafka import KafkaEventLog
from sluice.v1 import common_pb2

pytestmark = pytest.mark.integration

DONE = common_pb2.TokenUsage(output_tokens=1)
PARTITIONS = 4
HOME_A, HOME_B = (0, 2), (1, 3)


@pytest.fixture
async def logs() -> AsyncIterator[tuple[KafkaEventLog, KafkaEventLog, KafkaEventLog]]:
    """Gateway A, gateway B and a publisher, on a private topic."""
    bootstrap = load_settings().kafka.bootstrap
    topic = f"sluice.test-home-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    opened: list[KafkaEventLog] = []
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)])
        for _ in range(3):
            opened.append(KafkaEventLog(bootstrap, topic))
            await opened[-1].start()
        yield opened[0], opened[1], opened[2]
    finally:
        for log in opened:
            await log.close()
        await admin.delete_topics([topic])
        await admin.close()


def partition_of(run_id: str) -> int:
    """Where the producer's default partitioner (aiokafka's own) sends the run's key."""
    partitions = list(range(PARTITIONS))
    return int(DefaultPartitioner()(run_id.encode(), partitions, partitions))


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def stream_from_first(log: KafkaEventLog, run_id: str,
                      start: asyncio.Future[LogPosition]) -> asyncio.Task[list[int]]:
    """A Stream opened right after Submit (its run's start not recorded yet): the sequences it gets."""
    async def sequences() -> list[int]:
        events = log.follow_from_first(run_id, 0, lambda: asyncio.shield(start))
        return [event.sequence async for event in events]
    return asyncio.create_task(asyncio.wait_for(sequences(), 15))


async def write_run(publisher: KafkaEventLog, run_id: str, deltas: int) -> LogPosition:
    sequencer = RunEventSequencer(run_id)
    first = await publisher.append(sequencer.status(common_pb2.RUN_STATUS_RUNNING, 0))
    for token in range(deltas):
        await publisher.append(sequencer.delta([token], "", 0))
    await publisher.append(sequencer.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
    return first


async def test_each_gateway_reads_its_own_runs_partitions_and_still_streams_the_others_runs(
        logs, monkeypatch):
    monkeypatch.setattr(tail_module, "FOLLOW_LINGER_S", 0.5)
    gateway_a, gateway_b, publisher = logs
    new_run_a, new_run_b = await gateway_a.home_run_ids(HOME_A), await gateway_b.home_run_ids(HOME_B)
    run_a, run_b, waiting_b = str(new_run_a()), str(new_run_b()), str(new_run_b())
    assert partition_of(run_a) in HOME_A and {partition_of(run_b), partition_of(waiting_b)} <= set(HOME_B)

    never: asyncio.Future[LogPosition] = asyncio.get_running_loop().create_future()   # no ledger here
    streams = [stream_from_first(gateway_a, run_a, never), stream_from_first(gateway_b, run_b, never)]
    held_open = stream_from_first(gateway_b, waiting_b, never)       # a home stream of B's, to the end
    await until(lambda: all(log.live_tail is not None and log.live_tail.subscriptions >= 1
                            for log in (gateway_a, gateway_b)))
    first_a = await write_run(publisher, run_a, 2)
    await write_run(publisher, run_b, 2)
    assert [await stream for stream in streams] == [[1, 2, 3, 4], [1, 2, 3, 4]]
    tail_a, tail_b = gateway_a.live_tail, gateway_b.live_tail
    assert tail_a is not None and tail_b is not None
    assert set(tail_a.received) <= set(HOME_A) and sum(tail_a.received.values()) == 4
    assert set(tail_b.received) <= set(HOME_B) and sum(tail_b.received.values()) == 4

    # A stream of A's run on gateway B: resumed after its first event, and one opened before its run starts.
    async def resumed() -> list[int]:
        return [event.sequence async for event in gateway_b.follow(run_a, first_a, 1)]
    assert await asyncio.wait_for(resumed(), 15) == [2, 3, 4]
    later_a = str(new_run_a())
    live = stream_from_first(gateway_b, later_a, never)
    await until(lambda: tail_b.subscriptions == 2)
    assert partition_of(later_a) in tail_b.followed                  # followed while it is read
    await write_run(publisher, later_a, 3)
    assert await live == [1, 2, 3, 4, 5]
    # Once no stream reads them, A's partitions are paused after the linger; B's own stay followed
    # while a stream is on one of them.
    await until(lambda: tail_b.followed == set(HOME_B))
    await write_run(publisher, waiting_b, 0)
    assert await held_open == [1, 2]


async def test_a_gateway_whose_topic_is_not_there_yet_draws_plain_run_ids_and_follows_every_partition(
        monkeypatch):
    monkeypatch.setattr(kafka_module, "HOME_LOOKUP_S", 0.5)
    log = KafkaEventLog(load_settings().kafka.bootstrap, f"sluice.test-missing-{uuid.uuid4().hex[:8]}")
    await log.start()
    try:
        new_run_id = await log.home_run_ids(HOME_A)
        assert new_run_id is uuid.uuid4 and log.home is None
    finally:
        await log.close()
