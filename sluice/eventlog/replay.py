"""The process's shared replay reader: one consumer serving every range read that the
live tail's recent records cannot (a stream resumed long after its run began).

A consumer per replay would pay a broker bootstrap, a metadata request and an offset
lookup per stream; this one connects once and reads one range at a time:

    read(run, partition, [start, end))
       lock ── seek(partition, start), resume it ── fetch until end ── pause it ── unlock
                                                    └ keep the run's records only

Every partition stays assigned and paused between reads, so the consumer prefetches
nothing nobody asked for. Reads are serialized: they are the rare path, and one at a
time keeps the consumer's position unambiguous. A range is collected, then handed
over, so a slow reader never holds the consumer.
"""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import OffsetOutOfRangeError

POLL_TIMEOUT_MS = 200


class RangeDeleted(Exception):
    """Retention deleted part of the range asked for."""


class SharedReplay:
    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()
        self.reads = 0                     # ranges served (tests check that streams share it)

    async def close(self) -> None:
        async with self._lock:
            if self._consumer is not None:
                await self._consumer.stop()
                self._consumer = None

    async def _ready(self, partitions: list[int]) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None,
                                        enable_auto_commit=False, fetch_max_wait_ms=100,
                                        # A position that retention deleted must surface as an error,
                                        # never be moved silently to the earliest or latest record.
                                        auto_offset_reset="none")
            await consumer.start()
            assigned = [TopicPartition(self.topic, p) for p in partitions]
            consumer.assign(assigned)
            consumer.pause(*assigned)
            self._consumer = consumer
        return self._consumer

    async def start(self, partitions: list[int]) -> None:
        """Connect now, not on the first read: the live tail asks this consumer where a partition
        ends when a stream first needs it, and a stream opened as its run starts should not wait
        for a broker bootstrap then."""
        if self._consumer is None:
            async with self._lock:
                await self._ready(partitions)

    async def log_start(self, partitions: list[int], partition: int) -> int:
        """The partition's first offset still in the log (retention moves it forward)."""
        async with self._lock:
            consumer = await self._ready(partitions)
            tp = TopicPartition(self.topic, partition)
            return int((await consumer.beginning_offsets([tp]))[tp])

    async def log_ends(self, partitions: list[int]) -> dict[int, int]:
        """Each partition's end (its high watermark: one past its last durable record)."""
        async with self._lock:
            consumer = await self._ready(partitions)
            ends = await consumer.end_offsets([TopicPartition(self.topic, p) for p in partitions])
            return {tp.partition: int(end) for tp, end in ends.items()}

    async def read(self, key: bytes, partitions: list[int], partition: int, start: int,
                   end: int) -> list[bytes]:
        """The values of `key`'s records at offsets [start, end) of `partition` (one of `partitions`,
        the topic's). Raises RangeDeleted when `start` is below the partition's first offset."""
        async with self._lock:
            consumer = await self._ready(partitions)
            tp = TopicPartition(self.topic, partition)
            if start < (await consumer.beginning_offsets([tp]))[tp]:
                raise RangeDeleted(f"offset {start} of partition {partition} is past retention")
            self.reads += 1
            consumer.seek(tp, start)
            consumer.resume(tp)
            try:
                values: list[bytes] = []
                while await consumer.position(tp) < end:
                    try:
                        batch = await consumer.getmany(tp, timeout_ms=POLL_TIMEOUT_MS)
                    except OffsetOutOfRangeError as exc:
                        raise RangeDeleted(str(exc)) from exc      # deleted under a slow read
                    for record in batch.get(tp, []):
                        if record.offset >= end:
                            break
                        if record.key == key and record.value is not None:
                            values.append(record.value)
                return values
            finally:
                consumer.pause(tp)
