"""One live tail per process: a consumer following the end of every partition of the
events topic, handing each record to the streams that wait for its run.

Without it every live Stream would hold its own consumer reading its run's whole
partition (one connection per stream, each record fetched once per stream of its
partition). With it a stream needs its own consumer only to replay what was
written before it subscribed:

    subscribe(run)            tail position p: every record at offset >= p of the
       │                      run's partition will reach the subscription's queue
       ├─ replay [first, p)   bounded read with a short-lived consumer
       └─ then the queue      live records, as the tail reads them

`subscribe` reads the position and registers in one synchronous step, and the
tail dispatches a fetched batch synchronously too, so no record falls between
the replay and the queue; the reader's EventDeduper absorbs any overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition

log = logging.getLogger(__name__)

POLL_TIMEOUT_MS = 200
TAIL_FAILED = "the event log's live tail stopped: {error}"


class TailFailed(Exception):
    """The live tail lost its consumer; the stream should be reopened (it resumes by cursor)."""


@dataclass(slots=True)
class Subscription:
    run_key: bytes
    partition: int
    start_offset: int                    # the tail delivers records at or after this offset
    queue: asyncio.Queue[tuple[int, bytes] | BaseException] = field(default_factory=asyncio.Queue)


class LiveTail:
    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self._consumer: AIOKafkaConsumer | None = None
        self._next: dict[int, int] = {}                      # partition -> next offset to dispatch
        self._subscribers: dict[bytes, list[Subscription]] = {}
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None

    async def ensure_started(self, partitions: list[int]) -> None:
        """Start following `partitions` (the topic's, all of them) unless already running."""
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._run(sorted(partitions)), name=f"tail-{self.topic}")
        await asyncio.shield(self._ready)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._task, self._ready = None, None

    def subscribe(self, run_id: str, partition: int) -> Subscription:
        """Register for the run's live records (call after ensure_started)."""
        assert partition in self._next, f"partition {partition} is not followed by the tail of {self.topic}"
        subscription = Subscription(run_id.encode(), partition, self._next[partition])
        self._subscribers.setdefault(subscription.run_key, []).append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        waiting = self._subscribers.get(subscription.run_key, [])
        if subscription in waiting:
            waiting.remove(subscription)
        if not waiting:
            self._subscribers.pop(subscription.run_key, None)

    async def _run(self, partition_ids: list[int]) -> None:
        assert self._ready is not None
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None,
                                    enable_auto_commit=False, fetch_max_wait_ms=100)
        try:
            await consumer.start()
            partitions = [TopicPartition(self.topic, p) for p in partition_ids]
            consumer.assign(partitions)
            await consumer.seek_to_end(*partitions)
            for tp in partitions:
                self._next[tp.partition] = await consumer.position(tp)
            self._consumer = consumer
            self._ready.set_result(None)
            while True:
                batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
                for tp, records in batches.items():
                    for record in records:
                        self._dispatch(tp.partition, record.offset, record.key, record.value)
                    if records:
                        self._next[tp.partition] = records[-1].offset + 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("live tail of %s failed", self.topic)
            failure = exc if isinstance(exc, TailFailed) else TailFailed(TAIL_FAILED.format(error=exc))
            if not self._ready.done():
                self._ready.set_exception(failure)
            for waiting in self._subscribers.values():
                for subscription in waiting:
                    subscription.queue.put_nowait(failure)
            self._ready = None   # the next stream starts a fresh tail
        finally:
            with contextlib.suppress(Exception):
                await consumer.stop()
            self._consumer = None

    def _dispatch(self, partition: int, offset: int, key: bytes | None, value: bytes | None) -> None:
        if key is None or value is None:
            return
        for subscription in self._subscribers.get(key, ()):
            if subscription.partition == partition and offset >= subscription.start_offset:
                subscription.queue.put_nowait((offset, value))
