"""The Kafka event log against the real broker: exact replay by cursor, the seam between
replay and the live tail, a republished terminal event, locating a run by time."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from sluice.config import load_settings
from sluice.eventlog.events import RunEventSequencer
from sluice.eventlog.interface import LogPosition, ReaderTooSlow
from sluice.eventlog.kafka import KafkaEventLog
from sluice.v1 import common_pb2, runs_pb2

pytestmark = pytest.mark.integration

DONE = common_pb2.TokenUsage(output_tokens=1)


@pytest.fixture
async def log() -> AsyncIterator[KafkaEventLog]:
    events = KafkaEventLog.from_config(load_settings())
    await events.start()
    try:
        yield events
    finally:
        await events.close()


async def sequences(log: KafkaEventLog, run_id: str, start: LogPosition, after: int) -> list[int]:
    """The sequences follow() yields; a reader missing an event would wait forever, hence the bound."""
    received: list[int] = []

    async def read() -> None:
        async for event in log.follow(run_id, start, after):
            received.append(event.sequence)

    try:
        await asyncio.wait_for(read(), 10)
    except TimeoutError:
        raise AssertionError(f"follow() stalled after {received}") from None
    return received


async def test_follow_returns_exactly_the_events_after_the_cursor_and_ends_at_the_terminal(log):
    run_id = str(uuid.uuid4())
    seq = RunEventSequencer(run_id)
    first = await log.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
    for token in range(39):
        await log.append(seq.delta([token], "t", 0))
    await log.append(seq.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
    assert await sequences(log, run_id, first, 0) == list(range(1, 42))
    assert await sequences(log, run_id, first, 35) == list(range(36, 42))
    assert await sequences(log, run_id, first, 41) == []


async def test_followers_joining_at_any_moment_of_a_live_run_each_get_every_event_once(log):
    run_id = str(uuid.uuid4())
    seq = RunEventSequencer(run_id)
    first = await log.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
    rng = random.Random(7)

    async def late_follower(delay_s: float) -> list[int]:
        await asyncio.sleep(delay_s)
        return await sequences(log, run_id, first, 0)

    followers = [asyncio.create_task(late_follower(rng.uniform(0, 0.4))) for _ in range(12)]
    for token in range(150):
        await log.append(seq.delta([token], "", 0))
        if token % 5 == 0:
            await asyncio.sleep(0.01)  # let followers subscribe between appends
    await log.append(seq.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
    for received in await asyncio.wait_for(asyncio.gather(*followers), 30):
        assert received == list(range(1, 153))


async def test_a_terminal_event_published_twice_reaches_a_reader_once(log):
    run_id = str(uuid.uuid4())
    seq = RunEventSequencer(run_id)
    first = await log.append(seq.delta([1], "", 0))
    terminal = seq.terminal(common_pb2.RUN_STATUS_INTERRUPTED, DONE, "lost", 0)
    await log.append(terminal)
    await log.append(terminal)
    assert await sequences(log, run_id, first, 0) == [1, 2]
    assert [e.sequence for e in await log.read_durable(run_id, first)] == [1, 2]


async def test_a_run_whose_start_was_never_recorded_is_found_by_time(log):
    run_id = str(uuid.uuid4())
    since_ms = int(time.time() * 1000) - 1000
    seq = RunEventSequencer(run_id)
    first = await log.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
    await log.append(seq.delta([1, 2, 3], "", 0))
    located = await log.locate(run_id, since_ms)
    assert located is not None and located.partition == first.partition and located.offset <= first.offset
    durable = await log.read_durable(run_id, located)
    assert [(e.sequence, e.type) for e in durable] == [(1, runs_pb2.EVENT_TYPE_STATUS),
                                                       (2, runs_pb2.EVENT_TYPE_DELTA)]
    assert await log.locate(run_id, int(time.time() * 1000) + 60_000) is None


async def test_a_follower_that_stops_reading_is_cut_off_and_resumes_exactly_where_it_stopped():
    capacity = 8
    log = KafkaEventLog.from_config(load_settings())
    log.stream_capacity = capacity
    await log.start()
    try:
        run_id = str(uuid.uuid4())
        seq = RunEventSequencer(run_id)
        first = await log.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
        reader = log.follow(run_id, first, 0)
        received = [(await anext(reader)).sequence]     # subscribed; then it stops reading
        for token in range(3 * capacity):
            await log.append(seq.delta([token], "", 0))
        await log.append(seq.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
        with pytest.raises(ReaderTooSlow) as cut:
            async for event in reader:
                received.append(event.sequence)
        assert cut.value.after == received[-1] < 3 * capacity + 2
        assert log.live_tail is not None and log.live_tail.subscriptions == 0
        # Resumed through another process's log (any gateway may serve the resume): this one's tail,
        # sized for 8, may still be fetching the run's last records, and an answer carrying more than
        # 8 of them for one subscription cuts it off, however fast it reads.
        resumed = KafkaEventLog.from_config(load_settings())
        try:
            rest = await sequences(resumed, run_id, first, cut.value.after)
        finally:
            await resumed.close()
        assert received + rest == list(range(1, 3 * capacity + 3))
    finally:
        await log.close()


async def test_many_concurrent_followers_share_the_process_tail_and_one_replay_reader():
    # The tail starts with the first follow(), after the runs' first events: every follower
    # replays that start through the shared reader, then all 64 wait on the one tail.
    log = KafkaEventLog.from_config(load_settings())
    await log.start()
    try:
        runs = [str(uuid.uuid4()) for _ in range(8)]
        sequencers = [RunEventSequencer(run_id) for run_id in runs]
        firsts = [await log.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0)) for seq in sequencers]
        followers = [asyncio.create_task(sequences(log, run_id, first, 0))
                     for run_id, first in zip(runs, firsts, strict=True) for _ in range(8)]
        await asyncio.sleep(0.5)
        tail = log.live_tail
        assert tail is not None and tail.subscriptions == 64
        for token in range(20):
            for seq in sequencers:
                await log.append(seq.delta([token], "", 0))
        for seq in sequencers:
            await log.append(seq.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
        for received in await asyncio.wait_for(asyncio.gather(*followers), 30):
            assert received == list(range(1, 23))
        assert log.live_tail is tail and tail.subscriptions == 0
        assert log.replay.reads == 64                  # every one through the one shared consumer
    finally:
        await log.close()


async def ledger_never_answers() -> LogPosition | None:
    """A ledger that never records the run's start: a stream that needs it waits forever."""
    await asyncio.Event().wait()
    return None


async def test_a_run_followed_before_its_first_event_streams_without_waiting_for_the_ledger(log):
    run_id = str(uuid.uuid4())
    seq = RunEventSequencer(run_id)
    reader = asyncio.create_task(asyncio.wait_for(
        sequences_from_first(log, run_id, 0, ledger_never_answers), 10))
    await asyncio.sleep(0.5)                              # subscribed before the run's first event
    await log.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
    for token in range(5):
        await log.append(seq.delta([token], "", 0))
    await log.append(seq.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
    assert await reader == list(range(1, 8))


async def test_a_run_whose_first_event_the_tail_still_holds_streams_without_waiting_for_the_ledger(log):
    """A stream opened a moment after its run's first events went by on a partition the tail already
    follows (a client slow to open it after Submit): served from the tail's recent records."""
    run_id = str(uuid.uuid4())
    seq = RunEventSequencer(run_id)
    # Another run's stream has the tail follow the partitions (every one: no home partitions here).
    other = asyncio.create_task(sequences_from_first(log, str(uuid.uuid4()), 0, ledger_never_answers))
    try:
        await asyncio.sleep(0.5)
        tail = log.live_tail
        assert tail is not None and tail.subscriptions == 1
        written = [await log.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))]
        written += [await log.append(seq.delta([token], "", 0)) for token in range(3)]
        partition = written[0].partition
        for _ in range(100):                                # until the tail has fetched them
            if len(tail.held(run_id, partition)) == len(written):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the live tail never fetched the run's first records")
        readers = [asyncio.create_task(asyncio.wait_for(
            sequences_from_first(log, run_id, after, ledger_never_answers), 10)) for after in (0, 2)]
        await asyncio.sleep(0.2)
        await log.append(seq.delta([9], "", 0))             # and what follows comes live
        await log.append(seq.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
        assert await readers[0] == [1, 2, 3, 4, 5, 6]
        assert await readers[1] == [3, 4, 5, 6]
    finally:
        other.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await other


async def sequences_from_first(log: KafkaEventLog, run_id: str, after: int,
                               recorded_start: Callable[[], Awaitable[LogPosition | None]]) -> list[int]:
    return [e.sequence async for e in log.follow_from_first(run_id, after, recorded_start)]


async def test_a_run_that_began_before_it_was_followed_replays_from_the_start_the_ledger_gives(log):
    run_id = str(uuid.uuid4())
    seq = RunEventSequencer(run_id)
    first = await log.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
    await log.append(seq.delta([1], "", 0))
    asked = asyncio.Event()

    async def ledger_start() -> LogPosition | None:
        asked.set()
        return first

    async def read(after: int) -> list[int]:
        return [e.sequence async for e in log.follow_from_first(run_id, after, ledger_start)]

    readers = [asyncio.create_task(asyncio.wait_for(read(after), 10)) for after in (0, 1)]
    await asyncio.wait_for(asyncio.shield(asked.wait()), 5)
    await log.append(seq.delta([2], "", 0))               # live: its sequence 3 says earlier ones exist
    await log.append(seq.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0))
    assert await readers[0] == [1, 2, 3, 4]
    assert await readers[1] == [2, 3, 4]


LONG_LINGER_MS = 3_000


async def test_an_event_published_at_once_does_not_wait_out_the_linger_and_keeps_the_runs_order():
    config = load_settings()
    lingering = KafkaEventLog(config.kafka.bootstrap, config.kafka.events_topic, linger_ms=LONG_LINGER_MS)
    await lingering.start()
    try:
        run_id = str(uuid.uuid4())
        seq = RunEventSequencer(run_id)
        status = await lingering.publish(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
        first = await lingering.publish(seq.delta([5], "a", 0), at_once=True)
        # The STATUS before it leaves with it, both well before the linger would have let them go.
        positions = await asyncio.wait_for(asyncio.gather(status, first), LONG_LINGER_MS / 1000 / 2)
        later = await lingering.publish(seq.delta([6], "b", 0))
        await asyncio.sleep(0.2)
        assert not later.done(), "an event published plainly waits for its window's linger"
        assert positions[1].offset == positions[0].offset + 1
        # Other writers share the topic (parallel tests): something may land between `first` and
        # `later` in the partition, but never before `first`, and never in another partition.
        landed = await later
        assert landed.partition == positions[1].partition
        assert landed.offset > positions[1].offset
    finally:
        await lingering.close()


async def test_append_sends_at_once_what_it_waits_for_a_terminal_event_or_a_fence():
    # append() is how terminal events and fences are written, and its caller waits for the position:
    # it must not wait out the producer's linger (60 s here, so the bound below tells the two apart;
    # it leaves within kafka.APPEND_WITHIN_MS, with what else the window holds).
    config = load_settings()
    lingering = KafkaEventLog(config.kafka.bootstrap, config.kafka.events_topic, linger_ms=60_000)
    await lingering.start()
    try:
        run_id = str(uuid.uuid4())
        seq = RunEventSequencer(run_id)
        delta = await lingering.publish(seq.delta([5], "a", 0))
        terminal = await asyncio.wait_for(
            lingering.append(seq.terminal(common_pb2.RUN_STATUS_COMPLETED, DONE, "", 0)), 20)
        # What the run published before it leaves with it, in order.
        assert delta.done()
        assert terminal.partition == delta.result().partition
        assert terminal.offset > delta.result().offset
    finally:
        await lingering.close()
