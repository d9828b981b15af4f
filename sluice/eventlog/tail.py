"""One live tail per process: a fetcher (eventlog/fetcher.py) following the end of the partitions
of the events topic that some stream reads, handing each record to the streams that wait for its run, and
keeping the most recent records of each followed partition for streams that join a run in
progress.

Without it every live Stream would hold its own consumer reading its run's whole
partition (one connection per stream, each record fetched once per stream of its
partition). With it a stream costs a dictionary entry and a bounded buffer:

    subscribe(run, from)      tail position p: every record at offset >= p of the
       │                      run's partition will reach the subscription's buffer
       ├─ replay [from, p)    from the recent records when they reach back to `from`
       │                      (a stream opened as its run starts: the usual case),
       │                      else from the process's shared replay reader
       └─ then the buffer     live records, as the tail reads them

`subscribe` reads the position, the recent records and registers with no await in
between (once the partition is followed), and the tail dispatches a fetched batch
synchronously too, so no record falls between the replay and the buffer; the reader's
EventDeduper absorbs any overlap.

A fetch costs a gateway far more than the records it carries, so the tail fetches only while
some stream needs it: no partition is followed (fetched) at first; the first subscription after
a quiet spell follows partitions from their end (that end is the position p above: everything
before it is replayed), and FOLLOW_LINGER_S after the last subscription ended they are paused
again, their recent records dropped. Which partitions: in a process that places the runs it admits
on home partitions (eventlog/partitioning.py: a gateway), the subscription's partition and the home
ones, together (a stream on this gateway is almost always on a home partition, and they are all in
its one long poll); any other partition is followed only while a stream reads it, and paused
FOLLOW_LINGER_S after its last one, so each gateway reads its own runs' events, not every
gateway's. Elsewhere (home None): every partition. A partition followed while the long poll on the
others is at the broker gets its first records only when that poll returns (at most
TAIL_FETCH_WAIT_MS, and sooner while records flow on the others): a stream on a gateway that did
not admit its run may wait that long once. While records flow, batches are taken at most every
TAIL_BATCH_INTERVAL_MS, so that each fetch carries several. The fetcher is the lean read path
below aiokafka's consumer (its requests encoded by hand, records handed over as (offset, key,
value)): a fetch cost the gateway ~1 ms of CPU through the consumer.

Every record the tail hands out is below the partition's high watermark (a consumer's
fetch gets nothing else from the broker), so a stream only ever sends durable events.

A subscription's buffer is bounded: a reader that falls `capacity` records behind
(a client not reading its stream) is cut off with SubscriptionOverflow instead of
growing the process's memory; it resumes by cursor like any broken stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection

from sluice.eventlog import wire
from sluice.eventlog.fetcher import PartitionFetcher, Record

log = logging.getLogger(__name__)

# How long the broker may hold the tail's fetch when there is nothing new (fetch_min_bytes is 1: a
# fetch returns as soon as one record is durable, so this bounds only the idle long poll, never a
# record's delivery). At 100 ms, two idle gateways spent ~27 ms CPU/s (and the broker its share)
# answering ten empty fetches a second each; at 500 ms ~17 ms/s, with delivery after an idle spell
# unchanged (median 3-4 ms, max ~16 ms, publish at_once -> a follower, on the shared 2-core box).
# Not longer: the fetcher keeps one fetch in flight per broker, so a partition resumed for a new stream
# is fetched only once the fetch held for the partitions already followed returns. At 5 s a run's
# first event on a newly followed partition, beside an idle followed one, waited 2.7-3.7 s (3 of 4).
TAIL_FETCH_WAIT_MS = 500
# At most one fetched batch per this interval while records flow. A fetch costs the gateway far more
# than the records it carries (bench/bench_tail.py: ~0.7-0.9 ms of CPU per fetch against a few us per
# record on the shared 2-core box), and with fetch_min_bytes 1 a busy partition answers every fetch
# at once with the record or two published since the last: ~120 fetches/s per gateway at 200 events/s,
# 1.5 records each. Taking a batch no sooner than this after the previous one bounds the fetches and
# lets records gather in between; a record waits at most this long more, and a record after a quiet
# spell (a run's first token, one run at a time) not at all: its fetch is already waiting at the broker.
TAIL_BATCH_INTERVAL_MS = 20
TAIL_FAILED = "the event log's live tail stopped: {error}"
# Per partition. At seed 002's load (~6k events/s over 4 partitions) this reaches back
# ~5 s, far more than a stream opened as its run starts needs (the ledger records the
# run's first offset within milliseconds of publishing it); ~10 MB per process in all.
RECENT_RECORDS_PER_PARTITION = 8192
# How long the tail keeps fetching after its last subscription ended: a stream resumed within it
# finds its run's recent records still held, and streams that come and go one at a time do not each
# seek the partitions to their end. A process nobody streams from fetches nothing after it.
FOLLOW_LINGER_S = 10.0
# A stream's backlog between the tail and its gRPC writer. A reader keeping up holds a
# handful; at one event per token this is a few seconds of the fastest decode.
SUBSCRIPTION_CAPACITY = 1024


class TailFailed(Exception):
    """The live tail lost its fetcher; the stream should be reopened (it resumes by cursor)."""


class SubscriptionOverflow(Exception):
    """The reader fell `capacity` records behind the tail and was cut off."""

    def __init__(self, capacity: int) -> None:
        super().__init__(f"more than {capacity} events waited for this reader")
        self.capacity = capacity


class Subscription:
    """Live records of one run for one reader, at offsets >= start_offset, at most `capacity` unread."""

    __slots__ = ("_failure", "_items", "_loop", "_waiter", "capacity", "partition", "run_key", "start_offset")

    def __init__(self, run_key: bytes, partition: int, start_offset: int, capacity: int) -> None:
        self.run_key = run_key
        self.partition = partition
        self.start_offset = start_offset
        self.capacity = capacity
        self._items: deque[bytes] = deque()
        self._failure: BaseException | None = None
        # The reader waits on a future of the loop found here, once: asyncio.Event.wait looks the
        # running loop up on every wait, a getpid() system call in CPython 3.11 (once per batch per
        # stream: ~2% of the samples of a gateway at 64 x 300-token streams, py-spy).
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def offer(self, value: bytes) -> bool:
        """Buffer a record; False (and nothing buffered) when the buffer is full."""
        if len(self._items) >= self.capacity:
            return False
        self._items.append(value)
        self._wake()
        return True

    def fail(self, error: BaseException) -> None:
        """End the subscription: the reader's next take() raises `error`; the buffer is freed."""
        self._failure = error
        self._items.clear()
        self._wake()

    async def take(self) -> list[bytes]:
        """Every buffered record (at least one), oldest first: one wake-up per batch, not per record.
        One reader at a time."""
        while not self._items and self._failure is None:
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        if self._failure is not None:
            raise self._failure
        batch = list(self._items)
        self._items.clear()
        return batch


class RecentRecords:
    """The last `limit` records of one partition, indexed by key; complete from `covered_from`."""

    __slots__ = ("_by_key", "_order", "covered_from", "limit")

    def __init__(self, covered_from: int, limit: int) -> None:
        self.covered_from = covered_from        # every record at offset >= this is held (or evicted later)
        self.limit = limit
        self._order: deque[tuple[int, bytes]] = deque()                 # (offset, key), oldest first
        self._by_key: dict[bytes, deque[tuple[int, bytes]]] = {}        # key -> (offset, value), oldest first

    def add(self, offset: int, key: bytes, value: bytes) -> None:
        self._order.append((offset, key))
        self._by_key.setdefault(key, deque()).append((offset, value))
        if len(self._order) > self.limit:
            _, evicted_key = self._order.popleft()
            held = self._by_key[evicted_key]
            held.popleft()                      # a key's records are evicted in offset order too
            if not held:
                del self._by_key[evicted_key]
            self.covered_from = self._order[0][0]

    def held(self, key: bytes) -> list[bytes]:
        """Every record of the key still held, oldest first."""
        return [value for _, value in self._by_key.get(key, ())]

    def since(self, key: bytes, offset: int) -> list[bytes] | None:
        """The key's records at offsets >= `offset`, or None when they may reach back further than held."""
        if offset < self.covered_from:
            return None
        return [value for at, value in self._by_key.get(key, ()) if at >= offset]


class LiveTail:
    def __init__(self, bootstrap: str, topic: str, *, capacity: int = SUBSCRIPTION_CAPACITY,
                 recent_per_partition: int = RECENT_RECORDS_PER_PARTITION,
                 batch_interval_ms: float | None = None,
                 end_offsets: Callable[[list[int]], Awaitable[dict[int, int]]] | None = None,
                 home: Collection[int] | None = None) -> None:
        self.bootstrap = bootstrap
        # Where each partition ends now: the caller's (a connection it already holds), else asked by
        # the tail's fetcher on a connection apart from its long poll.
        self._end_offsets = end_offsets or self._own_end_offsets
        self.topic = topic
        self.capacity = capacity
        self.recent_per_partition = recent_per_partition
        self.batch_interval_ms = TAIL_BATCH_INTERVAL_MS if batch_interval_ms is None else batch_interval_ms
        self._fetcher: PartitionFetcher | None = None
        # The partitions the process places its runs on, followed with any subscription; None: every one.
        self.home = None if home is None else frozenset(home)
        # The partitions followed now (fetched, unpaused): each one's next offset to dispatch and its
        # recent records; since when each followed partition has been needed by no subscription.
        self._next: dict[int, int] = {}
        self._recent: dict[int, RecentRecords] = {}
        self._on_partition: dict[int, int] = {}        # partition -> subscriptions reading it
        self._idle_since: dict[int, float] = {}
        self._idle_check: asyncio.TimerHandle | None = None
        self._following: asyncio.Future[None] | None = None    # the partitions being sought to their end
        self._subscribers: dict[bytes, list[Subscription]] = {}
        self._partitions: list[int] = []
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self.received: dict[int, int] = {}                   # partition -> records fetched (bench, tests)

    async def ensure_started(self, partitions: list[int]) -> None:
        """Start the tail's fetcher on `partitions` (the topic's, all of them, each paused until a
        subscription needs it) unless already running."""
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

    @property
    def subscriptions(self) -> int:
        return sum(len(waiting) for waiting in self._subscribers.values())

    @property
    def followed(self) -> frozenset[int]:
        """The partitions the tail fetches now: those its subscriptions read and the home ones (every
        one without home) while it has some, each paused FOLLOW_LINGER_S after no subscription needs it."""
        return frozenset(self._next)

    async def subscribe(self, run_id: str, partition: int,
                        from_offset: int) -> tuple[Subscription, list[bytes] | None]:
        """Register for the run's live records (call after ensure_started), with the run's recent
        records at offsets in [from_offset, subscription.start_offset) when the tail still holds
        all of them (None: the caller replays that range from the log). A subscription to a partition
        the tail does not follow starts following it at its end (with the home ones, or every one)."""
        while partition not in self._next:
            await self._follow(partition)
        # From here to the return nothing awaits: no record falls between the recent ones and the buffer.
        subscription = Subscription(run_id.encode(), partition, self._next[partition], self.capacity)
        self._subscribers.setdefault(subscription.run_key, []).append(subscription)
        self._on_partition[partition] = self._on_partition.get(partition, 0) + 1
        self._note_idle()
        return subscription, self._recent[partition].since(subscription.run_key, from_offset)

    def hurry(self) -> None:
        """A subscriber's record is durable or about to be: fetch it without waiting out the batch
        interval (PartitionFetcher.hurry)."""
        if self._fetcher is not None:
            self._fetcher.hurry()

    def recent(self, subscription: Subscription, from_offset: int) -> list[bytes] | None:
        """The subscription's run's recent records from `from_offset` on (those it was handed as well:
        the reader's EventDeduper drops them), or None when the tail no longer holds all of them."""
        return self._recent[subscription.partition].since(subscription.run_key, from_offset)

    def held(self, run_id: str, partition: int) -> list[bytes]:
        """Every record of the run the tail still holds (of `partition`, none when not followed),
        oldest first. Records are evicted oldest first, so when the first of these is the run's first
        event, they are all of the run's records up to where the tail has read."""
        recent = self._recent.get(partition)
        return [] if recent is None else recent.held(run_id.encode())

    def unsubscribe(self, subscription: Subscription) -> None:
        waiting = self._subscribers.get(subscription.run_key, [])
        if subscription not in waiting:
            return
        waiting.remove(subscription)
        if not waiting:
            self._subscribers.pop(subscription.run_key, None)
        left = self._on_partition.pop(subscription.partition, 0) - 1
        if left > 0:
            self._on_partition[subscription.partition] = left
        self._note_idle()

    async def _follow(self, partition: int) -> None:
        """Start fetching `partition` from its end, with the home partitions (every partition without
        home) not followed yet: one offsets request. Concurrent callers wait for the first one's
        request, then check again (the caller loops until its partition is followed).

        The home ones with it: a partition followed while the tail's long poll on the others is at
        the broker gets its first records only when that poll returns (up to TAIL_FETCH_WAIT_MS: a
        run's first token, one at a time, waited for it); every stream on a home partition starts in
        the same poll."""
        if self._following is not None:
            await asyncio.wait({self._following})     # its outcome is the first caller's to raise
            return
        started = self._following = asyncio.get_running_loop().create_future()
        try:
            fetcher = self._fetcher
            if fetcher is None:
                raise TailFailed(TAIL_FAILED.format(error="its fetcher is not running"))
            wanted = set(self._partitions) if self.home is None else \
                {partition} | (self.home & set(self._partitions))
            ends = await self._end_offsets(sorted(wanted - set(self._next)))
            if self._fetcher is not fetcher:
                raise TailFailed(TAIL_FAILED.format(error="its fetcher stopped"))
            for followed, end in ends.items():
                if followed not in self._next:
                    fetcher.follow(followed, end)
                    self._start_following(followed, end)
            self._note_idle()
        finally:
            self._following = None
            started.set_result(None)

    async def _own_end_offsets(self, partitions: list[int]) -> dict[int, int]:
        assert self._fetcher is not None, "the tail's fetcher is not running"
        return await self._fetcher.list_offsets(partitions, wire.LATEST)

    def _start_following(self, partition: int, position: int) -> None:
        self._next[partition] = position
        self._recent[partition] = RecentRecords(position, self.recent_per_partition)

    def _needed(self, partition: int) -> bool:
        """Whether a subscription needs `partition` followed: one reads it, or it is a home partition
        (any partition, without home) of a tail with some subscription."""
        return partition in self._on_partition or bool(self._subscribers) and (
            self.home is None or partition in self.home)

    def _note_idle(self) -> None:
        """Note since when each followed partition has been needed by no subscription (a few
        partitions: cheap per subscription); the check stops fetching one FOLLOW_LINGER_S after."""
        for partition in self._next:
            if self._needed(partition):
                self._idle_since.pop(partition, None)
            elif partition not in self._idle_since:
                self._idle_since[partition] = time.monotonic()
        if self._idle_since and self._idle_check is None:
            self._idle_check = asyncio.get_running_loop().call_later(FOLLOW_LINGER_S, self._stop_idle)

    def _stop_idle(self) -> None:
        """Stop fetching each partition no subscription needed for FOLLOW_LINGER_S (its recent records
        go too: a later subscription follows it afresh from its end); check again when the next is due."""
        self._idle_check = None
        now, soonest = time.monotonic(), None
        for partition, since in list(self._idle_since.items()):
            left = since + FOLLOW_LINGER_S - now
            if left > 0:             # idle for less than the linger (or the loop's clock fired early)
                soonest = left if soonest is None else min(soonest, left)
                continue
            if self._fetcher is not None:
                self._fetcher.pause(partition)
            del self._idle_since[partition]
            self._next.pop(partition, None)
            self._recent.pop(partition, None)
        if soonest is not None:
            self._idle_check = asyncio.get_running_loop().call_later(soonest, self._stop_idle)

    async def _run(self, partition_ids: list[int]) -> None:
        assert self._ready is not None
        fetcher = PartitionFetcher(self.bootstrap, self.topic, self._dispatch_batch,
                                   max_wait_ms=TAIL_FETCH_WAIT_MS,
                                   batch_interval_s=self.batch_interval_ms / 1000, reset_to_end=True)
        try:
            await fetcher.start()
            self._partitions = partition_ids     # each fetched only while followed: none yet
            self._fetcher = fetcher
            self._ready.set_result(None)
            await fetcher.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("live tail of %s failed", self.topic)
            failure = exc if isinstance(exc, TailFailed) else TailFailed(TAIL_FAILED.format(error=exc))
            if not self._ready.done():
                self._ready.set_exception(failure)
            for waiting in self._subscribers.values():
                for subscription in waiting:
                    subscription.fail(failure)
            self._subscribers.clear()
            self._on_partition.clear()
            self._idle_since.clear()
            self._next.clear()
            self._recent.clear()
            self._ready = None   # the next stream starts a fresh tail
        finally:
            self._fetcher = None
            if self._idle_check is not None:
                self._idle_check.cancel()
                self._idle_check = None
            with contextlib.suppress(Exception):
                await fetcher.close()

    @property
    def fetches(self) -> int:
        """Fetch answers handled by the running fetcher (bench)."""
        return 0 if self._fetcher is None else self._fetcher.fetches

    def _dispatch_batch(self, partition: int, records: list[Record]) -> None:
        """One partition's fetched records, in offset order; none of a partition no longer followed,
        none from before where it is followed from (a fetch answered across a pause and a new start)."""
        self.received[partition] = self.received.get(partition, 0) + len(records)
        position = self._next.get(partition)
        if position is None or not records:
            return
        for offset, key, value in records:
            if offset >= position:
                self._dispatch(partition, offset, key, value)
        self._next[partition] = max(position, records[-1][0] + 1)

    def _dispatch(self, partition: int, offset: int, key: bytes | None, value: bytes | None) -> None:
        if key is None or value is None:
            return
        self._recent[partition].add(offset, key, value)
        waiting = self._subscribers.get(key)
        if not waiting:
            return
        for subscription in list(waiting):
            if subscription.partition != partition or offset < subscription.start_offset:
                continue
            if not subscription.offer(value):
                # Cut off: its buffer is freed now, and nothing more is kept for it.
                subscription.fail(SubscriptionOverflow(subscription.capacity))
                self.unsubscribe(subscription)
