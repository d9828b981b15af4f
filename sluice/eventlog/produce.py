"""The event log's write path: one window of record batches per process, shipped whole.

    publish ──▶ open window {partition: [BatchBuilder, …]}  (filled by every run of the process)
                    │ closed when the linger ends (one timer per window) or at once (a first token)
                    ▼
                ship: producer.send_batch(builder, topic, partition) per partition, in window order
                    │ aiokafka's sender: one ProduceRequest per broker carries every queued partition
                    ▼
                the batch's one future ──▶ each record's position = base offset + its index

Why not producer.send() per event: each call is a coroutine that re-checks metadata, estimates the
record's size, builds the partition set, creates a future per record (and a RecordMetadata per
record on the ack), and each new batch wakes the sender to arm its own linger timer; that is most
of the ~70-100 us of routing CPU a publish cost. Here a publish is one append into aiokafka's C batch
builder (its public batch API, `create_batch`/`send_batch`) and one future, and the sender is woken
once per window, not once per partition's batch. One window for all partitions also means that the
records of a linger leave together: one produce request per broker per window (aiokafka keeps one
request in flight per broker; what closes meanwhile waits and leaves in the next).

What holds, as with send(): the producer is idempotent with acks=all, so the broker drops a retried
duplicate and a partition's batches stay in the order they were handed over, which is the order of
the windows; a record's position is known only from the broker's acknowledgment of its whole batch,
so a future resolves only once the record is durable (a failed batch fails each of its records).
The producer itself runs with linger 0: the window has already waited.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer
from aiokafka.errors import ProducerClosed
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.structs import RecordMetadata

from sluice.eventlog.interface import LogPosition


@dataclass(slots=True)
class _Batch:
    """One record batch of a window and who waits for its records, in append order."""

    builder: BatchBuilder
    waiting: list[asyncio.Future[LogPosition]] = field(default_factory=list)   # [i]: the i-th record


Window = dict[int, list[_Batch]]   # partition -> its batches in this window (more than one once full)


class WindowedWriter:
    """Appends records of every run of the process into one window and ships it whole. Create it on
    the event loop that publishes; `producer` must be started, idempotent, acks=all, linger 0."""

    def __init__(self, producer: AIOKafkaProducer, topic: str, linger_s: float) -> None:
        self.producer = producer
        self.topic = topic
        self.linger_s = linger_s
        self._loop = asyncio.get_running_loop()
        self._window: Window | None = None           # open: records still being added
        self._timer: asyncio.TimerHandle | None = None   # ends the open window's linger
        self._closed_windows: collections.deque[Window] = collections.deque()   # waiting to ship, in order
        self._shipper: asyncio.Task[None] | None = None  # ships closed windows, one at a time
        self.windows_shipped = 0                     # counters a test or bench may read
        self.batches_shipped = 0

    def publish(self, partition: int, key: bytes, value: bytes, *,
                at_once: bool = False) -> asyncio.Future[LogPosition]:
        """Add one record to the open window; the future resolves with its position once durable.
        `at_once`: close the window now (it leaves with everything added before it)."""
        window = self._window
        if window is None:
            window = self._window = {}
            self._timer = self._loop.call_later(self.linger_s, self._close_window)
        batches = window.get(partition)
        if batches is None:
            batches = window[partition] = [_Batch(self.producer.create_batch())]
        batch = batches[-1]
        if batch.builder.append(timestamp=None, key=key, value=value) is None:
            # Full: a new batch behind it in the same window (an empty builder takes any record).
            batch = _Batch(self.producer.create_batch())
            batches.append(batch)
            batch.builder.append(timestamp=None, key=key, value=value)
        durable: asyncio.Future[LogPosition] = self._loop.create_future()
        batch.waiting.append(durable)
        if at_once:
            self._close_window()
        return durable

    def _close_window(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._window:
            self._closed_windows.append(self._window)
        self._window = None
        if self._shipper is None and self._closed_windows:
            self._shipper = self._loop.create_task(self._ship())

    async def _ship(self) -> None:
        """Hand the closed windows to the producer, oldest first; within one, each partition's batches
        in order. send_batch waits while the partition's previous batch is still queued (its request
        in flight): meanwhile later windows wait here, so a partition's order is the windows' order."""
        left: list[_Batch] = []     # of the window being shipped, the batches not handed over yet
        try:
            while self._closed_windows:
                window = self._closed_windows.popleft()
                left = [batch for batches in window.values() for batch in batches]
                for partition, batches in window.items():
                    for batch in batches:
                        await self._ship_batch(partition, batch)
                        left.pop(0)
                self.windows_shipped += 1
        except BaseException as exc:   # cancelled (the loop is closing): no record is left waiting
            closed = ProducerClosed(f"the event log's writer stopped before shipping: {exc!r}")
            queued = [batch for window in self._closed_windows for batches in window.values()
                      for batch in batches]
            for batch in left + queued:
                _fail(batch.waiting, closed)
            self._closed_windows.clear()
            raise
        finally:
            self._shipper = None

    async def _ship_batch(self, partition: int, batch: _Batch) -> None:
        try:
            sent = await self.producer.send_batch(batch.builder, self.topic, partition=partition)
        except Exception as exc:   # closed producer, a queue that never drained: each record fails
            _fail(batch.waiting, exc)
            return
        self.batches_shipped += 1
        sent.add_done_callback(lambda done: _settle(batch.waiting, partition, done))

    async def close(self) -> None:
        """Ship what is open and wait until every window has been handed to the producer (its stop()
        then waits for the acknowledgments)."""
        self._close_window()
        while self._shipper is not None:
            await asyncio.shield(self._shipper)


def _settle(waiting: list[asyncio.Future[LogPosition]], partition: int,
            sent: asyncio.Future[RecordMetadata]) -> None:
    """The broker answered for a whole batch: record i sits at the batch's base offset + i."""
    if sent.cancelled():
        for durable in waiting:
            durable.cancel()
        return
    if (error := sent.exception()) is not None:
        _fail(waiting, error)
        return
    base = sent.result().offset
    for index, durable in enumerate(waiting):
        if not durable.done():
            durable.set_result(LogPosition(partition, base + index))


def _fail(waiting: list[asyncio.Future[LogPosition]], error: BaseException) -> None:
    for durable in waiting:
        if not durable.done():
            durable.set_exception(error)
