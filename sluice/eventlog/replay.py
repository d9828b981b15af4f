"""The process's shared replay reader: one lean fetcher (eventlog/fetcher.py) serving every range
read that the live tail's recent records cannot (a stream resumed long after its run began, the
reaper reading what a lost driver left), and the partitions' first and end offsets.

A consumer per replay would pay a broker bootstrap, a metadata request and an offset lookup per
stream; this one connects once and reads a range by one-off fetches, no fetcher task and nothing
fetched that nobody asked for:

    read(run, partition, [start, end))
       fetch at start ── keep the run's records below end ── fetch at the next position ── … end
       ├ out of range (below the log's first offset) ── RangeDeleted
       └ no progress for STALL_LIMIT_S below end (the log ends under it) ── RangeLost

Reads do not wait for one another: each is its own sequence of fetches (a broker answers a
connection's requests in order, and a replay's fetch waits at most REPLAY_FETCH_WAIT_MS when
nothing is left). Offsets requests go on a connection apart from the fetches. A range is
collected, then handed over, so a slow reader never holds the fetcher.
"""

from __future__ import annotations

import asyncio

from aiokafka.errors import OffsetOutOfRangeError

from sluice.eventlog import wire
from sluice.eventlog.fetcher import PartitionFetcher, Record

# A range ends at or below the high watermark, so a replay's fetch finds records at once; this bounds
# the wait only when a record vanished under it (a truncated log).
REPLAY_FETCH_WAIT_MS = 100
# How long a read may get nothing below the end it was told of before it gives up. Nothing comes
# when the log now ends below that end (truncated under it: an unclean leader election lost the
# records), or, briefly, when a new leader's high watermark has not caught up yet (its followers'
# next fetches move it): long enough for the latter, and a read never asks forever.
STALL_LIMIT_S = 5.0


class RangeDeleted(Exception):
    """The log no longer holds part of the range asked for (retention deleted it)."""


class RangeLost(RangeDeleted):
    """The log ends below the end of the range, which it had reported durable: the records past its
    end were lost under the read (a truncated log). Nothing will bring them back."""


def _unused(partition: int, records: list[Record]) -> None:
    raise AssertionError("the replay reader fetches one-off, never through run()")


class SharedReplay:
    def __init__(self, bootstrap: str, topic: str, *, stall_limit_s: float = STALL_LIMIT_S) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.stall_limit_s = stall_limit_s
        self._fetcher: PartitionFetcher | None = None
        self._starting = asyncio.Lock()
        self.reads = 0                     # ranges served (tests check that streams share it)

    async def close(self) -> None:
        async with self._starting:
            if self._fetcher is not None:
                await self._fetcher.close()
                self._fetcher = None

    async def _ready(self) -> PartitionFetcher:
        if self._fetcher is None:
            async with self._starting:
                if self._fetcher is None:
                    fetcher = PartitionFetcher(self.bootstrap, self.topic, _unused,
                                               max_wait_ms=REPLAY_FETCH_WAIT_MS, client_id="sluice-replay")
                    await fetcher.start()
                    self._fetcher = fetcher
        return self._fetcher

    async def start(self) -> None:
        """Connect now, not on the first read: the live tail asks this reader where the partitions
        end when a stream first needs it, and a stream opened as its run starts should not wait for
        a broker bootstrap then."""
        await self._ready()

    async def log_start(self, partition: int) -> int:
        """The partition's first offset still in the log (retention moves it forward)."""
        return (await (await self._ready()).list_offsets([partition], wire.EARLIEST))[partition]

    async def log_ends(self, partitions: list[int]) -> dict[int, int]:
        """Each partition's end (its high watermark: one past its last durable record)."""
        return await (await self._ready()).list_offsets(partitions, wire.LATEST)

    async def offset_at(self, partition: int, timestamp_ms: int) -> int | None:
        """The partition's first offset written at or after `timestamp_ms`; None if none was."""
        found = (await (await self._ready()).list_offsets([partition], max(0, timestamp_ms)))[partition]
        return None if found < 0 else found

    async def read(self, key: bytes, partition: int, start: int, end: int) -> list[bytes]:
        """The values of `key`'s records at offsets [start, end) of `partition`. Raises RangeDeleted
        when `start` is below the partition's first offset (now, or by the time it is fetched): the
        broker answers a fetch there OFFSET_OUT_OF_RANGE, no offsets request needed first; RangeLost
        when the reads get nothing below `end` for stall_limit_s (the log ends below it)."""
        fetcher = await self._ready()
        self.reads += 1
        loop = asyncio.get_running_loop()
        values: list[bytes] = []
        position = start
        stalled_since: float | None = None
        while position < end:
            try:
                fetched = await fetcher.fetch_once(partition, position)
            except OffsetOutOfRangeError as exc:
                raise RangeDeleted(str(exc)) from exc      # deleted under a slow read
            if fetched.next_offset > position:
                stalled_since = None
            elif stalled_since is None:
                stalled_since = loop.time()
            elif loop.time() - stalled_since >= self.stall_limit_s:
                raise RangeLost(
                    f"{self.topic}-{partition} ends at {fetched.high_watermark}, below offset {end} it had"
                    f" reported durable: its records in [{position}, {end}) are gone (a truncated log)")
            position = fetched.next_offset
            for offset, record_key, value in fetched.records:
                if offset >= end:
                    return values
                if record_key == key and value is not None:
                    values.append(value)
        return values
