"""The lean read path (eventlog/fetcher.py) on the real broker: a private two-partition topic, records
written by aiokafka's producer to chosen partitions, read back by a PartitionFetcher. What a followed
partition hands over is exactly its records from the followed offset on, once each; a partition
paused (or sought elsewhere) while its fetch is at the broker gets nothing from that answer; an
offset past the end is the end for a tail and an error for a replay. The shared replay reader on it
reads one key's records of a range, refuses a range that retention deleted, and fails a range
whose end the log no longer reaches (truncated under it) instead of fetching at its end forever."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic, RecordsToDelete
from aiokafka.errors import OffsetOutOfRangeError
from aiokafka.structs import TopicPartition

from sluice.config import load_settings
from sluice.eventlog import wire
from sluice.eventlog.fetcher import PartitionFetcher, Record
from sluice.eventlog.replay import RangeDeleted, RangeLost, SharedReplay

pytestmark = pytest.mark.integration


class Topic:
    def __init__(self, bootstrap: str, name: str, producer: AIOKafkaProducer) -> None:
        self.bootstrap, self.name, self.producer = bootstrap, name, producer

    async def write(self, partition: int, *values: bytes) -> list[int]:
        """Write `values` to `partition` (key = value), each acknowledged; their offsets."""
        offsets = []
        for value in values:
            sent = await self.producer.send_and_wait(self.name, value=value, key=value, partition=partition)
            offsets.append(sent.offset)
        return offsets


@pytest.fixture
async def topic() -> AsyncIterator[Topic]:
    bootstrap = load_settings().kafka.bootstrap
    name = f"sluice.test-fetcher-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    try:
        await admin.create_topics([NewTopic(name, num_partitions=2, replication_factor=1)])
        await producer.start()
        yield Topic(bootstrap, name, producer)
    finally:
        await producer.stop()
        await admin.delete_topics([name])
        await admin.close()


class Collected:
    """What a fetcher handed over: (partition, offset, key, value) in the order handed."""

    def __init__(self) -> None:
        self.records: list[tuple[int, int, bytes | None, bytes | None]] = []

    def __call__(self, partition: int, records: list[Record]) -> None:
        self.records += [(partition, offset, key, value) for offset, key, value in records]

    def of(self, partition: int) -> list[tuple[int, bytes | None]]:
        return [(offset, value) for p, offset, _, value in self.records if p == partition]


async def until(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def running(fetcher: PartitionFetcher) -> asyncio.Task[None]:
    await fetcher.start()
    return asyncio.create_task(fetcher.run())


async def stop(fetcher: PartitionFetcher, task: asyncio.Task[None]) -> None:
    await fetcher.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_followed_partition_hands_over_each_record_from_its_offset_once_in_order_and_others_nothing(
        topic):
    before = await topic.write(0, b"a0", b"a1", b"a2")
    await topic.write(1, b"b0", b"b1")
    got = Collected()
    fetcher = PartitionFetcher(topic.bootstrap, topic.name, got, max_wait_ms=200)
    task = await running(fetcher)
    try:
        fetcher.follow(0, before[1])
        after = await topic.write(0, b"a3", b"a4")
        await topic.write(1, b"b2")
        await until(lambda: len(got.of(0)) == 4)
        assert got.of(0) == [(before[1], b"a1"), (before[2], b"a2"), (after[0], b"a3"), (after[1], b"a4")]
        assert got.of(1) == []                               # never followed: never fetched
        assert fetcher.position(0) == after[1] + 1
        fetcher.follow(1, 0)
        await until(lambda: len(got.of(1)) == 3)
        assert got.of(1) == [(0, b"b0"), (1, b"b1"), (2, b"b2")]
        await asyncio.sleep(0.5)                             # several more long polls: nothing twice
        assert len(got.records) == 7
    finally:
        await stop(fetcher, task)


async def test_records_wait_out_the_batch_interval_after_an_answer_unless_a_reader_hurries_the_fetcher(topic):
    # An answer that carried records starts a batch interval (60 s here): what is written meanwhile
    # waits for its end, unless hurry() says a reader waits for it (a run's first event, its RUNNING
    # committed): the fetcher then fetches at once.
    got = Collected()
    fetcher = PartitionFetcher(topic.bootstrap, topic.name, got, max_wait_ms=200, batch_interval_s=60.0)
    task = await running(fetcher)
    try:
        [first] = await topic.write(0, b"first")
        fetcher.follow(0, first)
        await until(lambda: len(got.of(0)) == 1)            # carried: the interval runs from here
        [second] = await topic.write(0, b"second")
        await asyncio.sleep(0.5)
        assert got.of(0) == [(first, b"first")]               # held for the interval
        fetcher.hurry()
        await until(lambda: len(got.of(0)) == 2, timeout_s=10)
        assert got.of(0) == [(first, b"first"), (second, b"second")]
    finally:
        await stop(fetcher, task)


async def test_a_partition_paused_while_its_fetch_waits_at_the_broker_gets_nothing_from_that_answer(topic):
    got = Collected()
    fetcher = PartitionFetcher(topic.bootstrap, topic.name, got, max_wait_ms=3000)
    task = await running(fetcher)
    try:
        [first] = await topic.write(0, b"first")             # the partition's leader knows the topic
        fetcher.follow(0, first + 1)
        await until(lambda: _in_flight(fetcher))
        await asyncio.sleep(0.3)                             # the long poll is at the broker now
        answered = fetcher.fetches
        fetcher.pause(0)
        [written] = await topic.write(0, b"while-paused")    # answers the poll at once
        await until(lambda: fetcher.fetches > answered)      # the answer came ...
        await asyncio.sleep(0.2)
        assert got.records == []                             # ... and handed nothing over
        fetcher.follow(0, written)
        await until(lambda: bool(got.records))
        await asyncio.sleep(0.3)
        assert got.records == [(0, written, b"while-paused", b"while-paused")]   # once
    finally:
        await stop(fetcher, task)


def _in_flight(fetcher: PartitionFetcher) -> bool:
    return any(not task.done() for task in asyncio.all_tasks() if task.get_name().startswith("fetch-"))


async def test_an_offset_past_the_end_is_followed_from_the_end_by_a_tail_and_raised_to_a_replay(topic):
    await topic.write(0, b"x0", b"x1")
    got = Collected()
    tail = PartitionFetcher(topic.bootstrap, topic.name, got, max_wait_ms=200, reset_to_end=True)
    task = await running(tail)
    try:
        tail.follow(0, 50)
        await until(lambda: tail.position(0) == 2)           # the end: one past the last record
        [later] = await topic.write(0, b"x2")
        await until(lambda: bool(got.records))
        assert got.records == [(0, later, b"x2", b"x2")]
    finally:
        await stop(tail, task)

    replay = PartitionFetcher(topic.bootstrap, topic.name, Collected(), max_wait_ms=200)
    task = await running(replay)
    try:
        replay.follow(1, 7)
        with pytest.raises(OffsetOutOfRangeError):
            await asyncio.wait_for(task, 15)
    finally:
        await stop(replay, task)


async def test_list_offsets_give_each_partitions_first_retained_offset_and_its_end(topic):
    await topic.write(0, b"r0", b"r1", b"r2", b"r3")
    await topic.write(1, b"s0")
    admin = AIOKafkaAdminClient(bootstrap_servers=topic.bootstrap)
    await admin.start()
    try:
        await admin.delete_records({TopicPartition(topic.name, 0): RecordsToDelete(3)})   # as retention would
    finally:
        await admin.close()
    fetcher = PartitionFetcher(topic.bootstrap, topic.name, Collected(), max_wait_ms=200)
    await fetcher.start()
    try:
        assert await fetcher.list_offsets([0, 1], wire.LATEST) == {0: 4, 1: 1}
        assert await fetcher.list_offsets([0, 1], wire.EARLIEST) == {0: 3, 1: 0}
    finally:
        await fetcher.close()


async def test_a_replay_reads_one_keys_records_in_a_range_and_refuses_a_range_retention_deleted(topic):
    sent = []
    for index in range(8):
        key = b"run-a" if index % 2 == 0 else b"run-b"
        done = await topic.producer.send_and_wait(topic.name, value=b"v%d" % index, key=key, partition=1)
        sent.append((done.offset, key, b"v%d" % index))
    replay = SharedReplay(topic.bootstrap, topic.name)
    await replay.start()
    try:
        start, end = sent[1][0], sent[6][0]          # [offset of v1, offset of v6)
        expected = [value for offset, key, value in sent if key == b"run-a" and start <= offset < end]
        assert expected == [b"v2", b"v4"]
        assert await replay.read(b"run-a", 1, start, end) == expected
        assert await replay.read(b"run-b", 1, 0, sent[-1][0] + 1) == [b"v1", b"v3", b"v5", b"v7"]
        assert await replay.log_ends([0, 1]) == {0: 0, 1: 8}
        admin = AIOKafkaAdminClient(bootstrap_servers=topic.bootstrap)
        await admin.start()
        try:
            await admin.delete_records({TopicPartition(topic.name, 1): RecordsToDelete(3)})
        finally:
            await admin.close()
        with pytest.raises(RangeDeleted):
            await replay.read(b"run-a", 1, 2, end)
        assert await replay.read(b"run-a", 1, 3, end) == [b"v4"]
    finally:
        await replay.close()


async def test_a_replay_whose_end_the_log_no_longer_reaches_fails_once_it_stalls_and_waits_out_a_short_gap(
        topic):
    # As when an unclean leader election truncated the log under the end the reader was told was
    # durable: every fetch at the log's end gets nothing. Before the fix, read() fetched again every
    # REPLAY_FETCH_WAIT_MS for ever.
    written = await topic.write(1, b"k", b"k")           # key = value
    end = written[-1] + 1
    replay = SharedReplay(topic.bootstrap, topic.name, stall_limit_s=1.0)
    await replay.start()
    try:
        began = asyncio.get_running_loop().time()
        with pytest.raises(RangeLost, match=rf"records in \[{end}, {end + 3}\) are gone"):
            await asyncio.wait_for(replay.read(b"k", 1, 0, end + 3), 20)
        assert asyncio.get_running_loop().time() - began >= 1.0     # not at the first empty fetch
        # A gap that fills within the limit (a new leader's high watermark catching up) is waited out.
        reading = asyncio.ensure_future(replay.read(b"k", 1, 0, end + 1))
        await asyncio.sleep(0.3)
        assert not reading.done()
        await topic.write(1, b"k")
        assert await asyncio.wait_for(reading, 20) == [b"k", b"k", b"k"]
    finally:
        await replay.close()
