"""The gateway's lean Kafka read path: the followed partitions of one topic fetched from their
leaders, their records handed over as (offset, key, value), below aiokafka's consumer.

aiokafka's consumer costs the gateway ~1 ms of CPU per fetch whatever it carries (a fetcher task
and its per-node bookkeeping, every request and response through generic Python protocol structs,
a ConsumerRecord per record, getmany's futures). This keeps what is worth keeping of aiokafka (its
client: bootstrap, metadata, connections, api versions, timeouts) and sends the two requests of
eventlog/wire.py over it:

    follow(p, offset) / pause(p)      positions of the followed partitions (no await)
    run()                             one loop per leader broker, one fetch in flight each:
                                         fetch its followed partitions at their positions
                                         ├ records -> on_records(p, [(offset, key, value)]), position
                                         │            moves past them; then wait until batch_interval
                                         │            after this answer before the next fetch (or
                                         │            until hurry(): a record is awaited now)
                                         ├ nothing new (long poll ran out) -> fetch again at once
                                         ├ leadership moved / broker gone -> refresh metadata, back off,
                                         │            the partition is fetched from its new leader
                                         └ offset out of range -> reset_to_end or raise
    list_offsets(ps, ts)              ListOffsets per leader, on a connection of its own

A broker answers a fetch only with records below the high watermark (durable ones). An answer is
applied to a partition only while its position is still the one fetched: a partition paused, or
sought elsewhere, while its fetch was at the broker gets nothing from that answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiokafka.client import AIOKafkaClient, ConnectionGroup
from aiokafka.errors import (
    IncompatibleBrokerVersion,
    KafkaConnectionError,
    NodeNotReadyError,
    OffsetOutOfRangeError,
    RequestTimedOutError,
    for_code,
)
from aiokafka.structs import TopicPartition

from sluice.eventlog import wire

log = logging.getLogger(__name__)

Record = tuple[int, bytes | None, bytes | None]        # offset, key, value
OnRecords = Callable[[int, list[Record]], None]

MAX_BYTES = 8 * 1024 * 1024                 # per fetch answer
PARTITION_MAX_BYTES = 1024 * 1024           # per partition of an answer (aiokafka's default)
RETRY_BACKOFF_S = 0.2                       # after a broker or leadership failure
ATTEMPTS = 25                               # of a one-off request (offsets, a replay's fetch): ~5 s
# Failures of one broker or of its leadership: the partition is fetched again once metadata says
# where; a reader waits meanwhile (as with aiokafka's consumer), it is not failed.
TRANSIENT = (KafkaConnectionError, NodeNotReadyError, RequestTimedOutError)


@dataclass(frozen=True, slots=True)
class Fetched:
    """What one fetch of one partition brought."""

    records: list[Record]
    next_offset: int             # where the next fetch starts
    high_watermark: int          # one past the partition's last durable record, as its leader says


class FetcherStopped(Exception):
    """The fetcher was closed: its run() ends with this."""


class _Header:
    __slots__ = ("correlation_id",)

    def __init__(self, correlation_id: int) -> None:
        self.correlation_id = correlation_id


class _Encoded:
    __slots__ = ("_raw",)

    def __init__(self, raw: bytes) -> None:
        self._raw = raw

    def encode(self) -> bytes:
        return self._raw


class RawRequest:
    """One pre-encoded request, in the shape aiokafka's connection sends and answers (its `prepare`
    checks the broker's versions, its header and body are bytes, its answer is decoded by
    `decode_body` from the raw frame). Relies on aiokafka's AIOKafkaConnection.send/_handle_frame of
    the version pinned in requirements.lock (tests/test_eventlog_fetcher.py runs it on a broker)."""

    __slots__ = ("RESPONSE_TYPE", "_api", "_body", "_decode", "_version")

    def __init__(self, api: int, version: int, body: bytes, decode: Callable[[bytes, int], Any]) -> None:
        self._api, self._version, self._body, self._decode = api, version, body, decode
        self.RESPONSE_TYPE = self            # the connection decodes the answer through it

    def prepare(self, versions: dict[int, tuple[int, int]]) -> RawRequest:
        low, high = versions.get(self._api, (0, -1))
        if not low <= self._version <= high:
            raise IncompatibleBrokerVersion(
                f"the broker answers api {self._api} in versions {low}-{high}, not {self._version}")
        return self

    def build_request_header(self, correlation_id: int, client_id: str) -> _Encoded:
        return _Encoded(wire.request_header(self._api, self._version, correlation_id, client_id))

    def encode(self) -> bytes:
        return self._body

    @staticmethod
    def parse_response_header(frame: io.BytesIO) -> _Header:
        return _Header(int.from_bytes(frame.read(4), "big", signed=True))

    def decode(self, frame: io.BytesIO) -> Any:
        return self._decode(frame.getvalue(), frame.tell())


class PartitionFetcher:
    """Fetches the followed partitions of `topic`. Create, start and run it on the loop that uses it."""

    def __init__(self, bootstrap: str, topic: str, on_records: OnRecords, *, max_wait_ms: int,
                 batch_interval_s: float = 0.0, reset_to_end: bool = False,
                 client_id: str = "sluice-tail") -> None:
        self.topic = topic
        self.on_records = on_records
        self.max_wait_ms = max_wait_ms
        self.batch_interval_s = batch_interval_s
        self.reset_to_end = reset_to_end          # offset out of range: the end (a tail) or raise (a replay)
        self.fetches = 0                          # answers handled (bench, tests)
        self._client = AIOKafkaClient(bootstrap_servers=bootstrap, client_id=client_id)
        self._positions: dict[int, int] = {}       # followed partition -> next offset to fetch
        self._leaders: dict[int, int] = {}         # partition -> leader node, from the last metadata
        self._changed = asyncio.Event()            # followed partitions or leaders changed
        self._hurry = asyncio.Event()              # hurry() since the last batch interval began
        self._closed = False

    def hurry(self) -> None:
        """A reader waits for a record that is durable, or about to be (a run's first event, its
        RUNNING committed): the batch interval in progress ends now, or the next one is skipped, so
        that the record is fetched as soon as the broker has it. With several leader brokers, one of
        their loops takes it."""
        self._hurry.set()

    async def start(self) -> list[int]:
        """Connect and learn the topic's partitions and their leaders."""
        await self._client.bootstrap()
        await self._client.add_topic(self.topic)
        partitions = self._client.cluster.partitions_for_topic(self.topic)
        if not partitions:
            await self._refresh()
            partitions = self._client.cluster.partitions_for_topic(self.topic)
        self._learn_leaders()
        return sorted(partitions or ())

    async def close(self) -> None:
        self._closed = True
        self._changed.set()
        await self._client.close()

    @property
    def followed(self) -> frozenset[int]:
        return frozenset(self._positions)

    def position(self, partition: int) -> int | None:
        return self._positions.get(partition)

    def follow(self, partition: int, offset: int) -> None:
        """Fetch `partition` from `offset` on (its records before it are never handed over)."""
        self._positions[partition] = offset
        self._changed.set()

    def pause(self, partition: int) -> None:
        self._positions.pop(partition, None)

    async def run(self) -> None:
        """Fetch until closed (raises FetcherStopped then) or an unexpected failure (raised)."""
        serving: dict[int, asyncio.Task[None]] = {}
        try:
            while not self._closed:
                self._changed.clear()
                wanted = {self._leaders.get(partition, -1) for partition in self._positions}
                for node in wanted - {-1} - set(serving):
                    serving[node] = asyncio.create_task(self._serve(node), name=f"fetch-{self.topic}-{node}")
                waiting = asyncio.ensure_future(self._changed.wait())
                timeout = RETRY_BACKOFF_S if -1 in wanted else None    # a partition without a leader
                await asyncio.wait({waiting, *serving.values()}, timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                for node, task in list(serving.items()):
                    if task.done():
                        del serving[node]
                        task.result()                  # an unexpected failure ends the fetcher
                if -1 in wanted and not self._changed.is_set():
                    await self._refresh()
            raise FetcherStopped("the fetcher was closed")
        finally:
            for task in serving.values():
                task.cancel()
            for task in serving.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def list_offsets(self, partitions: list[int], timestamp: int) -> dict[int, int]:
        """Each partition's offset at `timestamp` (wire.LATEST: its high watermark, wire.EARLIEST: its
        first retained offset), asked of its leader on a connection apart from the fetches (a broker
        answers one connection's requests in order: it would wait behind a long poll)."""
        found: dict[int, int] = {}
        pending = list(partitions)
        for attempt in range(ATTEMPTS):
            by_leader: dict[int, list[int]] = {}
            for partition in pending:
                by_leader.setdefault(self._leaders.get(partition, -1), []).append(partition)
            pending = by_leader.pop(-1, [])
            for node, asked in by_leader.items():
                request = wire.list_offsets_body(self.topic, asked, timestamp)
                try:
                    answer = await self._client.send(node, RawRequest(
                        wire.LIST_OFFSETS_API, wire.LIST_OFFSETS_VERSION, request, wire.decode_list_offsets),
                        group=ConnectionGroup.COORDINATION)
                except TRANSIENT:
                    if attempt == ATTEMPTS - 1:
                        raise
                    pending += asked
                    continue
                for partition in asked:
                    error, offset = answer.get(partition, (wire.LEADER_NOT_AVAILABLE, -1))
                    if error == wire.NONE:
                        found[partition] = offset
                    elif error in wire.RETRIABLE:
                        pending.append(partition)
                    else:
                        raise for_code(error)(f"ListOffsets of {self.topic}-{partition}")
            if not pending:
                return found
            await self._recover()
        raise NodeNotReadyError(f"no leader answered for {self.topic} partitions {pending}")

    async def fetch_once(self, partition: int, offset: int) -> Fetched:
        """One fetch of `partition` at `offset` from its leader, apart from run(): its records from
        `offset` on (none if the broker held the fetch max_wait_ms without any), where the next
        fetch starts and the partition's high watermark. Raises OffsetOutOfRangeError when `offset`
        is outside the partition's log."""
        for _ in range(ATTEMPTS):
            node = self._leaders.get(partition, -1)
            if node != -1:
                try:
                    answer = await self._fetch(node, [(partition, offset)])
                except TRANSIENT:
                    answer = []
                for fetched in answer:
                    if fetched.partition != partition or fetched.error in wire.RETRIABLE:
                        continue
                    if fetched.error == wire.OFFSET_OUT_OF_RANGE:
                        raise OffsetOutOfRangeError({TopicPartition(self.topic, partition): offset})
                    if fetched.error != wire.NONE:
                        raise for_code(fetched.error)(f"fetch of {self.topic}-{partition} at {offset}")
                    self.fetches += 1
                    records, following = wire.decode_records(fetched.records, offset)
                    return Fetched(records, following, fetched.high_watermark)
            await self._recover()
        raise NodeNotReadyError(f"no leader of {self.topic}-{partition} answered a fetch")

    async def _serve(self, node: int) -> None:
        """Fetch the followed partitions `node` leads, one request at a time, until it leads none."""
        loop = asyncio.get_running_loop()
        failing = False
        while not self._closed:
            asked = [(partition, offset) for partition, offset in self._positions.items()
                     if self._leaders.get(partition) == node]
            if not asked:
                return
            try:
                answer = await self._fetch(node, asked)
            except TRANSIENT as exc:
                if self._closed:
                    return
                if not failing:                 # once per outage, not at every retry
                    log.warning("fetch of %s from node %s failed (%s): retrying as metadata says",
                                self.topic, node, exc)
                failing = True
                await self._recover()
                continue
            if failing:
                log.info("fetch of %s from node %s answered again", self.topic, node)
                failing = False
            self.fetches += 1
            answered = loop.time()
            carried = stale = False
            fetched_at = dict(asked)
            for fetched in answer:
                partition = fetched.partition
                offset = fetched_at.get(partition)
                if offset is None or self._positions.get(partition) != offset:
                    continue                   # paused or sought elsewhere meanwhile: not this answer's
                if fetched.error == wire.NONE:
                    if not fetched.records:
                        continue
                    records, self._positions[partition] = wire.decode_records(fetched.records, offset)
                    if records:
                        carried = True
                        self.on_records(partition, records)
                elif fetched.error == wire.OFFSET_OUT_OF_RANGE:
                    if not self.reset_to_end:
                        raise OffsetOutOfRangeError({TopicPartition(self.topic, partition): offset})
                    end = (await self.list_offsets([partition], wire.LATEST))[partition]
                    log.warning("%s-%d: offset %d out of range, following from the end %d",
                                self.topic, partition, offset, end)
                    if self._positions.get(partition) == offset:
                        self._positions[partition] = end
                elif fetched.error in wire.RETRIABLE:
                    stale = True
                else:
                    raise for_code(fetched.error)(f"fetch of {self.topic}-{partition} at {offset}")
            if stale:
                await self._recover()
            elif carried and self.batch_interval_s > 0:
                # Let records gather at the broker: the next fetch takes them all at once. A record after
                # a quiet spell is not held: the fetch then waits at the broker and answers at once.
                # Nor is one a reader is known to wait for (hurry()).
                if not self._hurry.is_set():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(max(0.0, answered + self.batch_interval_s - loop.time())):
                            await self._hurry.wait()
                self._hurry.clear()

    async def _fetch(self, node: int, asked: list[tuple[int, int]]) -> list[wire.FetchedPartition]:
        """One Fetch of `asked` (partition, offset) pairs from `node`, its answer decoded."""
        body = wire.fetch_body(self.topic, asked, max_wait_ms=self.max_wait_ms, min_bytes=1,
                               max_bytes=MAX_BYTES, partition_max_bytes=PARTITION_MAX_BYTES)
        return await self._client.send(node, RawRequest(wire.FETCH_API, wire.FETCH_VERSION, body,
                                                        wire.decode_fetch))

    async def _recover(self) -> None:
        await asyncio.sleep(RETRY_BACKOFF_S)
        await self._refresh()

    async def _refresh(self) -> None:
        if self._closed:
            return
        await self._client.force_metadata_update()
        self._learn_leaders()

    def _learn_leaders(self) -> None:
        cluster = self._client.cluster
        leaders = {partition: cluster.leader_for_partition(TopicPartition(self.topic, partition))
                   for partition in cluster.partitions_for_topic(self.topic) or ()}
        leaders = {partition: -1 if node is None else node for partition, node in leaders.items()}
        if leaders != self._leaders:
            self._leaders = leaders
            self._changed.set()
