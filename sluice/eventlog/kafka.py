"""Kafka backend of the event log (aiokafka).

Writes: one idempotent producer per process (enable_idempotence, acks=all),
key = run id so that one run's events land in one partition, in order; value =
a serialized sluice.v1.RunEvent. The producer is shared by every run of the
process and pipelined: `publish` only appends a record to its partition's open
batch (eventlog/produce.py: every run's records of a linger window, one batch
per partition handed to the producer at a time, through aiokafka's batch API)
and returns a future that resolves once the broker acknowledged it to all
in-sync replicas; a run keeps several events in flight and their order holds
(one partition per run, idempotent producer, a partition's batches in order).
A run's first token is published `at_once`: the window ends now and its batches
leave without waiting out the linger (TTFT pays no batching). `append` =
publish and wait, for the caller that needs the position (a terminal event, a
fence): within the window like any publish, but leaving no later than
APPEND_WITHIN_MS after it, so that the terminal events of runs that end close
together, and the DELTAs around them, share one produce request (and each
gateway one fetch of them) where at once each took a request of its own. A
position is durable when its future resolves, and only then may it be recorded
in the ledger.

Reads: two lean fetchers per process (eventlog/fetcher.py: aiokafka's client and
connections, requests and records decoded by hand, no consumer) for every stream:
one tail (eventlog/tail.py) that fans the end of the topic out to the streams
waiting for each run and keeps each partition's recent records, and one shared
replay reader (eventlog/replay.py) for the older part of a resumed stream, the
durable part of a run (read_durable) and offsets (locate). A replay keeps the
records whose key is the run id. A consumer's fetch only ever gets records below
the high watermark, i.e. records that are durable, which is what lets Stream
promise that no client sees an event the log could still lose.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from sluice.config import Settings
from sluice.config.settings import KafkaSection
from sluice.eventlog.events import EventDeduper
from sluice.eventlog.interface import CursorPastRetention, LogPosition, LogUnavailable, ReaderTooSlow
from sluice.eventlog.partitioning import home_partitions, partition_of, run_id_on
from sluice.eventlog.produce import WindowedWriter
from sluice.eventlog.replay import RangeDeleted, SharedReplay
from sluice.eventlog.tail import (
    RECENT_RECORDS_PER_PARTITION,
    SUBSCRIPTION_CAPACITY,
    LiveTail,
    Subscription,
    SubscriptionOverflow,
    TailFailed,
)
from sluice.v1 import runs_pb2

log = logging.getLogger(__name__)

HOME_LOOKUP_S = 10.0     # how long a gateway's start waits to learn the topic's partition count
LINGER_MS = 20           # the writer's window across runs ([kafka].producer_linger_ms)
# An appended event (a terminal event, a fence) leaves with its window, but no later than this after it
# was appended, whatever the linger: its caller waits for it (a run's end, a takeover). With the default
# linger it is the linger itself.
APPEND_WITHIN_MS = 20
PARTITION_CACHE = 8192   # runs whose partition is remembered
MAX_REQUEST_BYTES = 1_048_576   # the largest record a publish accepts (aiokafka's default max_request_size)


CLUSTER_BROKERS = 3   # [kafka].brokers of the local cluster (infra/kafka_cluster.sh)


def configured_bootstrap(kafka: KafkaSection) -> str:
    """The brokers [kafka].brokers selects: the single broker's address, or the cluster's list."""
    return kafka.cluster_bootstrap if kafka.brokers == CLUSTER_BROKERS else kafka.bootstrap


def replication(kafka: KafkaSection) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) of the events topic: (3, 2) on the cluster, so an
    acks=all write survives one node; (1, 1) on the single broker."""
    return (3, 2) if kafka.brokers == CLUSTER_BROKERS else (1, 1)


# A follower's transient failures: the tail lost its consumer, or the brokers did not answer. Mapped
# to LogUnavailable (UNAVAILABLE at the RPC edge): the reader resumes by cursor.
LOG_FAILURES = (TailFailed, KafkaError)


class KafkaEventLog:
    """EventLog over one Kafka topic. Create and close it on the event loop that uses it."""

    def __init__(self, bootstrap: str, topic: str, *, stream_capacity: int = SUBSCRIPTION_CAPACITY,
                 recent_per_partition: int = RECENT_RECORDS_PER_PARTITION,
                 linger_ms: int = LINGER_MS, append_within_ms: int = APPEND_WITHIN_MS) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.stream_capacity = stream_capacity              # events a follower may leave unread
        self.recent_per_partition = recent_per_partition    # records the tail keeps for late joiners
        self.linger_ms = linger_ms
        self.append_within_ms = append_within_ms
        self._producer: AIOKafkaProducer | None = None
        self._writer: WindowedWriter | None = None   # the open window of records, on the producer
        self._producer_lock = asyncio.Lock()
        self._tail: LiveTail | None = None   # started by the first follow()
        self.replay = SharedReplay(bootstrap, topic)
        # run id -> partition, so the partitioner's murmur2 runs once per run, not per event
        self._partitions: dict[bytes, int] = {}
        # The partitions this process places the runs it admits on (home_run_ids); None: it does not.
        self.home: frozenset[int] | None = None

    @classmethod
    def from_config(cls, config: Settings) -> KafkaEventLog:
        return cls(bootstrap=configured_bootstrap(config.kafka), topic=config.kafka.events_topic,
                   linger_ms=config.kafka.producer_linger_ms)

    async def _ready_producer(self) -> AIOKafkaProducer:
        async with self._producer_lock:
            if self._producer is None:
                producer = AIOKafkaProducer(
                    bootstrap_servers=self.bootstrap,
                    enable_idempotence=True,   # broker drops retried duplicates; order kept per partition
                    acks="all",
                    linger_ms=0,   # the writer's window lingers (across runs); deltas are coalesced upstream
                    max_request_size=MAX_REQUEST_BYTES,
                )
                await producer.start()
                self._writer = WindowedWriter(producer, self.topic, self.linger_ms / 1000, MAX_REQUEST_BYTES)
                self._producer = producer
            return self._producer

    async def start(self) -> None:
        await self._ready_producer()

    async def close(self) -> None:
        if self._tail is not None:
            await self._tail.close()
            self._tail = None
        await self.replay.close()
        if self._writer is not None:
            await self._writer.close()
            self._writer = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def publish(self, event: runs_pb2.RunEvent, *,
                      at_once: bool = False) -> asyncio.Future[LogPosition]:
        return await self._publish(event, at_once, None)

    async def _publish(self, event: runs_pb2.RunEvent, at_once: bool,
                       within_s: float | None) -> asyncio.Future[LogPosition]:
        writer = self._writer
        if writer is None:
            await self._ready_producer()
            writer = self._writer
            assert writer is not None, "a started producer has its writer"
        key = event.run_id.encode()
        partition = self._partitions.get(key)
        if partition is None:
            if len(self._partitions) >= PARTITION_CACHE:
                self._partitions.clear()
            partition = self._partitions[key] = await self.partition_of(event.run_id)
        return writer.publish(partition, key, event.SerializeToString(), at_once=at_once, within_s=within_s)

    async def append(self, event: runs_pb2.RunEvent) -> LogPosition:
        # Within the window, not at once: the runs that end close together share a request (at once,
        # each end was a produce request and a fetch per gateway of its own: a third of a 2-token
        # run's broker requests), and none waits longer than APPEND_WITHIN_MS for it.
        return await (await self._publish(event, False, self.append_within_ms / 1000))

    async def partition_of(self, run_id: str) -> int:
        """The partition the producer's default partitioner sends this run's key to."""
        producer = await self._ready_producer()
        partitions = sorted(await producer.partitions_for(self.topic))
        return partitions[partition_of(run_id.encode(), len(partitions))]

    async def home_run_ids(self, configured: Collection[int] = ()) -> Callable[[], uuid.UUID]:
        """From now on this process places the runs it admits on its home partitions (`configured`,
        else one by process id: partitioning.home_partitions), and its live tail follows those (and
        any other only while a stream reads it) instead of every partition. Returns the run-id
        chooser its admission draws ids with (eventlog/partitioning.py). A topic whose partitions
        cannot be learned within HOME_LOOKUP_S (not created yet) leaves it as before: random run ids,
        every partition followed."""
        producer = await self._ready_producer()
        try:
            async with asyncio.timeout(HOME_LOOKUP_S):
                count = len(await producer.partitions_for(self.topic))
        except (KafkaError, TimeoutError) as exc:
            log.warning("no home partitions: the partitions of %s are unknown (%r)", self.topic, exc)
            return uuid.uuid4
        home = self.home = home_partitions(count, configured, os.getpid())
        if self._tail is not None:
            self._tail.home = home
        return lambda: run_id_on(home, count)

    async def locate(self, run_id: str, since_ms: int) -> LogPosition | None:
        partition = await self.partition_of(run_id)
        found = await self.replay.offset_at(partition, since_ms)
        return None if found is None else LogPosition(partition, found)

    async def read_durable(self, run_id: str, start: LogPosition) -> list[runs_pb2.RunEvent]:
        dedupe = EventDeduper(after=0)
        end = (await self.replay.log_ends([start.partition]))[start.partition]     # what is durable now
        events = []
        for value in await self._replay(run_id, start, end, dedupe):
            event = runs_pb2.RunEvent.FromString(value)
            if dedupe.accept(event):
                events.append(event)
            if dedupe.finished:
                break
        return events

    async def follow(self, run_id: str, start: LogPosition,
                     after: int) -> AsyncIterator[runs_pb2.RunEvent]:
        tail, _ = await self._ready_tail(run_id)
        subscription, recent = await self._subscribe(tail, run_id, start.partition, start.offset)
        try:
            async for event in self._deliver(run_id, start, after, subscription, recent, []):
                yield event
        finally:
            tail.unsubscribe(subscription)

    async def follow_from_first(self, run_id: str, after: int,
                                recorded_start: Callable[[], Awaitable[LogPosition | None]],
                                first_recorded: Callable[[], Awaitable[object]] | None = None,
                                ) -> AsyncIterator[runs_pb2.RunEvent]:
        tail, partitions = await self._ready_tail(run_id)
        # Where this process's partitioner puts the run (the metadata _ready_tail just read: no second look).
        partition = partitions[partition_of(run_id.encode(), len(partitions))]
        subscription, _ = await self._subscribe(tail, run_id, partition, -1)
        held = tail.held(run_id, partition)
        if held and runs_pb2.RunEvent.FromString(held[0]).sequence == 1:
            # The run's first event went by before this stream subscribed (a client slow to open
            # the stream after Submit, a replica quick to answer), and the tail still holds every
            # record of the run since: served from there, as a first event received live is
            # (once the ledger has committed RUNNING), without waiting for the ledger to record
            # where the run starts.
            try:
                if first_recorded is not None:
                    await first_recorded()
                async for event in self._deliver(run_id, None, after, subscription, [], held):
                    yield event
            finally:
                tail.unsubscribe(subscription)
            return
        first_live = asyncio.ensure_future(subscription.take())
        ledger = asyncio.ensure_future(recorded_start())
        try:
            await asyncio.wait({first_live, ledger}, return_when=asyncio.FIRST_COMPLETED)
            live: list[bytes] = []
            if first_live.done() and not first_live.exception():
                live = first_live.result()
                if runs_pb2.RunEvent.FromString(live[0]).sequence == 1:
                    # The run's first event came after the subscription: nothing to replay. It is
                    # STATUS RUNNING: handed over once the ledger has committed RUNNING (DESIGN.md: a
                    # transition is durable in PostgreSQL before anyone is told of it); the live
                    # events meanwhile wait in the subscription's bounded buffer.
                    ledger.cancel()
                    if first_recorded is not None:
                        await first_recorded()
                    async for event in self._deliver(run_id, None, after, subscription, [], live):
                        yield event
                    return
            start = await ledger
            if start is None:
                return
            if start.partition != subscription.partition:
                # Not where this process's partitioner put the run (a producer that chose otherwise):
                # the plain path reads the partition the ledger names.
                async for event in self.follow(run_id, start, after):
                    yield event
                return
            if not live:
                if not first_live.done():
                    first_live.cancel()            # take() only waits: nothing buffered is lost
                else:
                    live = first_live.result()     # raises a cut-off, as take() would
            recent = tail.recent(subscription, start.offset)
            async for event in self._deliver(run_id, start, after, subscription, recent, live):
                yield event
        except SubscriptionOverflow as exc:
            raise ReaderTooSlow(run_id, after, exc.capacity) from exc
        except LOG_FAILURES as exc:
            raise LogUnavailable(run_id, exc) from exc
        finally:
            for waiting in (first_live, ledger):
                waiting.cancel()
            tail.unsubscribe(subscription)

    async def _deliver(self, run_id: str, start: LogPosition | None, after: int, subscription: Subscription,
                       recent: list[bytes] | None, live: list[bytes]) -> AsyncIterator[runs_pb2.RunEvent]:
        """The run's events > after: what was written before `subscription` (`recent`, or replayed
        from `start`; nothing when `start` is None), then `live` (already taken from it), then it."""
        dedupe = EventDeduper(after)
        try:
            # What was written before the subscription: the tail's recent records, or the shared reader.
            if recent is not None and start is not None:
                await self._check_retained(run_id, start, after)
            if recent is None:
                assert start is not None, "a replay needs the run's start"
                recent = await self._replay(run_id, start, subscription.start_offset, dedupe)
            batch = recent + live
            # Everything after it: handed over by the process's live tail.
            while True:
                for value in batch:
                    event = runs_pb2.RunEvent.FromString(value)
                    if dedupe.accept(event):
                        yield event
                    if dedupe.finished:
                        return
                batch = await subscription.take()
        except SubscriptionOverflow as exc:
            raise ReaderTooSlow(run_id, dedupe.last_sequence, exc.capacity) from exc
        except LOG_FAILURES as exc:
            raise LogUnavailable(run_id, exc) from exc

    async def _check_retained(self, run_id: str, start: LogPosition, after: int) -> None:
        """A stream that starts before the live tail is served from the tail's memory only while the
        log still holds the run: records retention deleted stay refused (OUT_OF_RANGE) whichever
        process is asked, at one offsets request per such stream (a stream opened as its run starts
        is handed its first event live and never pays it)."""
        if start.offset < await self.replay.log_start(start.partition):
            raise CursorPastRetention(run_id, after)

    async def _replay(self, run_id: str, start: LogPosition, end: int, dedupe: EventDeduper) -> list[bytes]:
        try:
            return await self.replay.read(run_id.encode(), start.partition, start.offset, end)
        except RangeDeleted as exc:
            raise CursorPastRetention(run_id, dedupe.last_sequence) from exc

    def hurry(self) -> None:
        if self._tail is not None:
            self._tail.hurry()

    @property
    def live_tail(self) -> LiveTail | None:
        """The process's tail, once a follow() started it."""
        return self._tail

    @staticmethod
    async def _subscribe(tail: LiveTail, run_id: str, partition: int,
                         from_offset: int) -> tuple[Subscription, list[bytes] | None]:
        try:
            return await tail.subscribe(run_id, partition, from_offset)
        except LOG_FAILURES as exc:
            raise LogUnavailable(run_id, exc) from exc

    async def _ready_tail(self, run_id: str) -> tuple[LiveTail, list[int]]:
        """The started tail, and the topic's partitions (the producer's metadata)."""
        if self._tail is None:
            self._tail = LiveTail(self.bootstrap, self.topic, capacity=self.stream_capacity,
                                  recent_per_partition=self.recent_per_partition,
                                  end_offsets=self.replay.log_ends, home=self.home)
        try:
            producer = await self._ready_producer()
            partitions = sorted(await producer.partitions_for(self.topic))
            await self._tail.ensure_started(partitions)
            await self.replay.start()                  # where the partitions end is asked of it
        except LOG_FAILURES as exc:
            raise LogUnavailable(run_id, exc) from exc
        return self._tail, partitions
