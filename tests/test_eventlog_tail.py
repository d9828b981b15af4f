"""The live tail's bookkeeping without a broker: recent records by key, bounded subscriptions,
and fan-out of one partition's records to the subscriptions of each run."""

from __future__ import annotations

import asyncio

import pytest

from sluice.eventlog import tail as tail_module
from sluice.eventlog.tail import LiveTail, RecentRecords, Subscription, SubscriptionOverflow


def tail_at(next_offsets: dict[int, int], *, capacity: int = 4, recent: int = 8) -> LiveTail:
    """A tail positioned as if its fetcher had just started at `next_offsets` (no broker)."""
    tail = LiveTail("unused:0", "topic", capacity=capacity, recent_per_partition=recent)
    for partition, offset in next_offsets.items():
        tail._start_following(partition, offset)
    return tail


def feed(tail: LiveTail, partition: int, records: list[tuple[bytes, bytes]]) -> None:
    """Dispatch `records` as one fetched batch at the partition's next offsets, as the tail's loop does."""
    first = tail._next[partition]
    tail._dispatch_batch(partition, [record(partition, first + i, key, value)
                                     for i, (key, value) in enumerate(records)])


def record(partition: int, offset: int, key: bytes, value: bytes) -> tuple[int, bytes, bytes]:
    """A record as the tail's fetcher hands it over: (offset, key, value)."""
    return offset, key, value


def test_recent_records_return_one_keys_records_from_an_offset_while_they_reach_back_that_far():
    recent = RecentRecords(covered_from=100, limit=4)
    for offset, key in enumerate([b"a", b"b", b"a", b"a"], start=100):
        recent.add(offset, key, f"{key.decode()}{offset}".encode())
    assert recent.since(b"a", 100) == [b"a100", b"a102", b"a103"]
    assert recent.since(b"a", 101) == [b"a102", b"a103"]
    assert recent.since(b"c", 100) == []
    assert recent.since(b"a", 99) is None               # before the tail started: not held


def test_recent_records_evict_the_oldest_and_then_no_longer_cover_its_offset():
    recent = RecentRecords(covered_from=0, limit=3)
    for offset in range(5):
        recent.add(offset, b"k" if offset % 2 else b"j", bytes([offset]))
    assert recent.covered_from == 2
    assert recent.since(b"j", 1) is None
    assert recent.since(b"j", 2) == [bytes([2]), bytes([4])]
    assert recent.since(b"k", 2) == [bytes([3])]
    assert set(recent._by_key) == {b"j", b"k"}         # evicted entries leave no empty key behind


async def test_a_subscription_hands_over_its_whole_buffer_in_one_take():
    subscription = Subscription(b"run", 0, 0, capacity=4)
    assert subscription.offer(b"1") and subscription.offer(b"2")
    assert await subscription.take() == [b"1", b"2"]
    waiting = asyncio.create_task(subscription.take())
    await asyncio.sleep(0)
    assert not waiting.done()
    subscription.offer(b"3")
    assert await asyncio.wait_for(waiting, 1) == [b"3"]


async def test_a_reader_that_falls_capacity_records_behind_is_cut_off_and_its_buffer_freed():
    tail = tail_at({0: 50}, capacity=4)
    slow, _ = await tail.subscribe("run-a", 0, 50)
    fast, _ = await tail.subscribe("run-a", 0, 50)
    feed(tail, 0, [(b"run-a", b"e1"), (b"run-a", b"e2")])
    assert await fast.take() == [b"e1", b"e2"]
    feed(tail, 0, [(b"run-a", b"e3"), (b"run-a", b"e4")])
    assert await fast.take() == [b"e3", b"e4"]
    # slow holds e1..e4 unread: its capacity. The next record cuts it off.
    feed(tail, 0, [(b"run-a", b"e5")])
    with pytest.raises(SubscriptionOverflow):
        await slow.take()
    assert len(slow._items) == 0                       # nothing kept for a reader that is gone
    assert tail.subscriptions == 1                     # and the tail no longer feeds it
    assert await fast.take() == [b"e5"]


async def test_records_reach_only_the_subscriptions_of_their_run_at_or_after_their_start():
    tail = tail_at({0: 10, 1: 0}, capacity=100)
    feed(tail, 0, [(b"run-a", b"early")])
    a, recent_a = await tail.subscribe("run-a", 0, 10)
    b, recent_b = await tail.subscribe("run-b", 0, 10)
    assert recent_a == [b"early"] and recent_b == []
    assert a.start_offset == 11
    feed(tail, 0, [(b"run-b", b"b1"), (b"run-a", b"a1"), (b"run-c", b"c1")])
    feed(tail, 1, [(b"run-a", b"other partition")])
    assert list(a._items) == [b"a1"] and list(b._items) == [b"b1"]


async def test_a_subscription_from_before_what_the_tail_holds_gets_no_recent_records():
    tail = tail_at({0: 10}, recent=2)
    feed(tail, 0, [(b"run-a", b"x"), (b"run-a", b"y"), (b"run-a", b"z")])
    _, recent = await tail.subscribe("run-a", 0, 10)
    assert recent is None                              # 10 was evicted: the caller replays from the log
    _, recent = await tail.subscribe("run-a", 0, 11)
    assert recent == [b"y", b"z"]


class Fetcher:
    """What the tail asks of its fetcher: follow and pause partitions (no broker)."""

    def __init__(self) -> None:
        self.positions: dict[int, int] = {}

    def follow(self, partition: int, offset: int) -> None:
        self.positions[partition] = offset

    def pause(self, partition: int) -> None:
        del self.positions[partition]


def tail_over(partitions: int, home: set[int] | None) -> tuple[LiveTail, Fetcher, list[list[int]]]:
    """A started tail of a topic of `partitions` whose partition p ends at 100 * p; the offsets
    requests it makes are listed."""
    asked: list[list[int]] = []

    async def ends(wanted: list[int]) -> dict[int, int]:
        asked.append(wanted)
        return {partition: 100 * partition for partition in wanted}

    tail = LiveTail("unused:0", "topic", end_offsets=ends, home=home)
    fetcher = Fetcher()
    tail._fetcher = fetcher   # type: ignore[assignment]
    tail._partitions = list(range(partitions))
    return tail, fetcher, asked


async def test_a_tail_with_home_partitions_follows_those_and_the_ones_its_streams_read_and_no_other(
        monkeypatch):
    monkeypatch.setattr(tail_module, "FOLLOW_LINGER_S", 0.05)
    tail, fetcher, asked = tail_over(4, home={1, 3})
    home_stream, _ = await tail.subscribe("run-h", 3, -1)
    assert asked == [[1, 3]] and fetcher.positions == {1: 100, 3: 300}
    assert home_stream.start_offset == 300
    visiting, _ = await tail.subscribe("run-v", 2, -1)             # another gateway's run
    assert asked == [[1, 3], [2]] and tail.followed == {1, 2, 3}
    feed(tail, 2, [(b"run-v", b"v1")])
    assert list(visiting._items) == [b"v1"]
    tail.unsubscribe(visiting)
    await asyncio.sleep(0.15)                                      # past the linger: 2 is paused,
    assert tail.followed == {1, 3} and set(fetcher.positions) == {1, 3}   # home stays (a stream is on 3)
    tail.unsubscribe(home_stream)
    await asyncio.sleep(0.15)
    assert tail.followed == frozenset() and fetcher.positions == {}


async def test_a_tail_without_home_partitions_follows_every_partition_with_its_first_stream():
    tail, fetcher, asked = tail_over(4, home=None)
    await tail.subscribe("run", 2, -1)
    assert asked == [[0, 1, 2, 3]] and set(fetcher.positions) == {0, 1, 2, 3}
