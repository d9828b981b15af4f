"""The event log's write path: one linger window per process, record batches per partition.

    publish ──▶ partition p's queue [batch, batch, …]   (filled by every run of the process;
                │                                        the last batch takes new records)
                │ due when the window ends: one timer per window (brought forward by an append's
                │ bound), or at once for a first token
                ▼
    ship: producer.send_batch(p's first due batch) unless p's leader owes an answer (a batch of
                │ any of its partitions unanswered): then p's batch waits for it, with the others
                │ aiokafka's sender: one ProduceRequest per broker carries every partition handed over
                ▼
    the batch's one future ──▶ each record's position = base offset + its index; p's next batch ships

Why not producer.send() per event: each call is a coroutine that re-checks metadata, estimates the
record's size, builds the partition set, creates a future per record (and a RecordMetadata per
record on the ack), and each new batch wakes the sender to arm a linger timer of its own; that was
most of the ~70 us of routing CPU a publish cost (bench_data_path --only publish). Here a publish is
one append into aiokafka's C batch builder (its public batch API, create_batch/send_batch) and one
future. One window for all partitions also means that the records of a linger leave together: one
produce request per broker per window, where a linger per partition's batch sent each partition as
its own linger ended (one request each, since aiokafka keeps one request in flight per broker).

One batch per partition handed over and unanswered, as aiokafka's sender itself sends them: the
records arriving meanwhile join the partition's next batch, which ships when the answer comes (so a
busy partition sends fewer, larger batches, and send_batch never waits for room, which would hold up
the other partitions behind a slow leader). And nothing handed over to a broker that owes an answer:
the sender sends one request at a time to a broker, so those batches would wait for the answer
anyway, and the partitions answered then would follow in a request of their own (a window's records
in two or three requests, each costing the broker as much as one carrying them all). Held back,
the due batches of every partition the broker leads leave in the one request after the answer.

What holds, as with send(): the producer is idempotent with acks=all, so the broker drops a retried
duplicate and a partition's records are stored in the order they were published; a record's position
is known only from the broker's acknowledgment of its whole batch, so a future resolves only once the
record is durable. A failed batch fails each of its records and every record of its partition queued
behind it (none of those was handed over): a run's events after a failed one are never written.
The producer itself runs with linger 0: the window has already waited.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError, ProducerClosed
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.structs import RecordMetadata, TopicPartition

from sluice.eventlog.interface import LogPosition


@dataclass(slots=True)
class _Batch:
    """One record batch of a partition and who waits for its records, in append order."""

    builder: BatchBuilder
    window: int                  # the window it was opened in: due once that window ended
    waiting: list[asyncio.Future[LogPosition]] = field(default_factory=list)   # [i]: the i-th record


@dataclass(slots=True)
class _Partition:
    queued: collections.deque[_Batch] = field(default_factory=collections.deque)   # not handed over
    sent: asyncio.Future[RecordMetadata] | None = None   # the batch handed over, not yet answered


class WindowedWriter:
    """Appends the records of every run of the process into per-partition batches and ships them when
    the window they were opened in ends. Create it on the event loop that publishes; `producer` must
    be started, idempotent, acks=all, linger 0."""

    def __init__(self, producer: AIOKafkaProducer, topic: str, linger_s: float,
                 max_request_bytes: int) -> None:
        self.producer = producer
        self.topic = topic
        self.linger_s = linger_s
        self.max_request_bytes = max_request_bytes   # the producer's max_request_size
        self._loop = asyncio.get_running_loop()
        self._partitions: dict[int, _Partition] = {}
        self._window = 0                                 # the open window's number
        self._timer: asyncio.TimerHandle | None = None   # ends the open window's linger
        self._shipper: asyncio.Task[None] | None = None  # hands due batches to the producer
        self.batches_shipped = 0

    def publish(self, partition: int, key: bytes, value: bytes, *, at_once: bool = False,
                within_s: float | None = None) -> asyncio.Future[LogPosition]:
        """Add one record; the future resolves with its position once it is durable. `at_once`: end
        the window now (everything added before it leaves with it); `within_s`: end it no later than
        this from now (sooner than the linger would). A record larger than a request
        may be is refused here, as send() refuses it: the broker would refuse its batch, and that
        batch's sequence numbers, already taken, would leave the idempotent producer out of order
        (OutOfOrderSequenceNumber on the partition's next batch: the producer stops)."""
        if len(value) > self.max_request_bytes // 2:   # a cheap guard first: events are far smaller
            size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, [])
            if size > self.max_request_bytes:
                raise MessageSizeTooLargeError(f"an event of {size} bytes, over {self.max_request_bytes}")
        state = self._partitions.get(partition)
        if state is None:
            state = self._partitions[partition] = _Partition()
        queued = state.queued
        if not queued or queued[-1].builder.append(timestamp=None, key=key, value=value) is None:
            # None, or the last batch is full: a new one behind it (an empty builder takes any record).
            queued.append(_Batch(self.producer.create_batch(), self._window))
            queued[-1].builder.append(timestamp=None, key=key, value=value)
        durable: asyncio.Future[LogPosition] = self._loop.create_future()
        queued[-1].waiting.append(durable)
        if at_once:
            self._end_window()
        elif self._timer is None:
            linger = self.linger_s if within_s is None else min(within_s, self.linger_s)
            self._timer = self._loop.call_later(linger, self._end_window)
        elif within_s is not None and self._timer.when() > self._loop.time() + within_s:
            self._timer.cancel()
            self._timer = self._loop.call_later(within_s, self._end_window)
        return durable

    def _end_window(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._window += 1
        self._ship_soon()

    def _due(self, state: _Partition) -> bool:
        return state.sent is None and bool(state.queued) and state.queued[0].window < self._window

    def _leader(self, partition: int) -> int | None:
        return self.producer.client.cluster.leader_for_partition(TopicPartition(self.topic, partition))

    def _ready(self) -> list[tuple[int, _Partition]]:
        """The partitions whose first batch is due and whose leader owes no answer: the producer
        sends one request at a time to a broker, so a batch handed over while its leader owes one
        would wait for it anyway, and the partitions answered then would follow in a request of their
        own. Held until the answer, they all leave in one."""
        owing = {self._leader(partition) for partition, state in self._partitions.items()
                 if state.sent is not None}
        return [(partition, state) for partition, state in self._partitions.items()
                if self._due(state) and (not owing or self._leader(partition) not in owing)]

    def _ship_soon(self) -> None:
        if self._shipper is None:
            self._shipper = self._loop.create_task(self._ship())

    async def _ship(self) -> None:
        """Hand every partition's first due batch to the producer, where none is unanswered. None of
        these awaits waits for room: the partition has no batch queued in the producer."""
        try:
            while due := self._ready():
                for partition, state in due:
                    await self._hand_over(partition, state)
        finally:
            self._shipper = None

    async def _hand_over(self, partition: int, state: _Partition) -> None:
        batch = state.queued.popleft()
        try:
            sent = await self.producer.send_batch(batch.builder, self.topic, partition=partition)
        except Exception as exc:   # a closed producer, a fatal producer error: the records fail
            self._failed(state, batch, exc)
            return
        except BaseException as exc:   # cancelled as the loop closes: nobody is left waiting either
            self._failed(state, batch, ProducerClosed(f"the writer stopped: {exc!r}"))
            raise
        state.sent = sent
        self.batches_shipped += 1
        sent.add_done_callback(lambda done: self._answered(partition, state, batch, done))

    def _answered(self, partition: int, state: _Partition, batch: _Batch,
                  sent: asyncio.Future[RecordMetadata]) -> None:
        """The broker answered for a whole batch: record i sits at the batch's base offset + i."""
        state.sent = None
        error = ProducerClosed("batch cancelled") if sent.cancelled() else sent.exception()
        if error is not None:
            self._failed(state, batch, error)
            return
        base = sent.result().offset
        for index, durable in enumerate(batch.waiting):
            if not durable.done():
                durable.set_result(LogPosition(partition, base + index))
        # Its leader may owe nothing now: every partition it holds back may go (the shipper runs after
        # the answers of the request's other partitions, which come in the same response).
        if any(self._due(other) for other in self._partitions.values()):
            self._ship_soon()

    @staticmethod
    def _failed(state: _Partition, batch: _Batch, error: BaseException) -> None:
        """The batch failed: its records, and the partition's records behind it, are not written."""
        for failed in (batch, *state.queued):
            for durable in failed.waiting:
                if not durable.done():
                    durable.set_exception(error)
        state.queued.clear()

    async def close(self) -> None:
        """End the window and wait until every record was answered for (shipping what each answer
        lets go)."""
        self._end_window()
        while True:
            if self._shipper is not None:
                await asyncio.shield(self._shipper)
                continue
            unanswered = [state.sent for state in self._partitions.values() if state.sent is not None]
            if not unanswered:
                break
            await asyncio.wait(unanswered)   # their _answered callbacks ran first: they were added first
