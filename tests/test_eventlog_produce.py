"""The event log's write path against a real broker (issue 9 point 2): the process's window of record
batches (eventlog/produce.py). Every publish resolves with the exact position of its own record, each
run's order holds across windows, full batches and first tokens sent at once, and a position is only
ever reported once the broker acknowledged it.

A throwaway broker of its own (ports, data dir), so that it can be paused without touching the
shared one, with its request log on (produce requests counted as bench_platform --request-log does).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner

from bench.bench_platform import RequestCounter
from sluice.config import load_settings
from sluice.eventlog.events import RunEventSequencer
from sluice.eventlog.interface import LogPosition
from sluice.eventlog.kafka import APPEND_WITHIN_MS, KafkaEventLog
from sluice.v1 import common_pb2, runs_pb2
from tests.test_chaos_infra import single_broker

pytestmark = pytest.mark.integration

LINGER_MS = 15
BATCH_BYTES = 16384   # aiokafka's default max_batch_size: a window's batch for a partition fills at this


@pytest.fixture(scope="module")
def broker() -> Iterator[dict[str, str]]:
    with single_broker("produce-kafka", KAFKA_REQUEST_LOG="debug") as env:
        yield env


@contextlib.asynccontextmanager
async def lingering_log(broker: dict[str, str], linger_ms: int,
                        append_within_ms: int = APPEND_WITHIN_MS) -> AsyncIterator[KafkaEventLog]:
    linger = {"SLUICE_KAFKA__PRODUCER_LINGER_MS": str(linger_ms)}
    log = KafkaEventLog.from_config(load_settings(environ={**os.environ, **broker, **linger}))
    log.append_within_ms = append_within_ms
    await log.start()
    try:
        yield log
    finally:
        await log.close()


@pytest.fixture
async def events(broker: dict[str, str]) -> AsyncIterator[KafkaEventLog]:
    async with lingering_log(broker, LINGER_MS) as log:
        yield log


async def records_at(log: KafkaEventLog,
                     positions: list[LogPosition]) -> dict[LogPosition, runs_pb2.RunEvent]:
    """The event stored at each position, read back with a plain consumer."""
    consumer = AIOKafkaConsumer(bootstrap_servers=log.bootstrap, enable_auto_commit=False)
    await consumer.start()
    found: dict[LogPosition, runs_pb2.RunEvent] = {}
    try:
        for partition in sorted({position.partition for position in positions}):
            tp = TopicPartition(log.topic, partition)
            wanted = {position.offset for position in positions if position.partition == partition}
            consumer.assign([tp])
            consumer.seek(tp, min(wanted))
            while wanted - {p.offset for p in found if p.partition == partition}:
                batch = await asyncio.wait_for(consumer.getmany(tp, timeout_ms=500), 10)
                for record in batch.get(tp, []):
                    if record.offset in wanted:
                        event = runs_pb2.RunEvent.FromString(record.value)
                        found[LogPosition(partition, record.offset)] = event
    finally:
        await consumer.stop()
    return found


async def test_each_publish_resolves_with_its_own_records_position_and_every_runs_order_holds(events):
    """24 runs publish 12 events each, interleaved, in rounds a few ms apart (so rounds share windows
    or not), some events large enough that a partition's batch fills within a window, each run's first
    DELTA at once. The position each future gave must hold that very event, and a run's positions must
    rise with its sequence, all in one partition."""
    rng = random.Random(9)
    runs = [RunEventSequencer(str(uuid.uuid4())) for _ in range(24)]
    published: list[tuple[str, int, asyncio.Future[LogPosition]]] = []
    for round_ in range(12):
        for seq in runs:
            if round_ == 0:
                event = seq.status(common_pb2.RUN_STATUS_RUNNING, 0)
            else:
                text = "x" * rng.choice((10, 10, BATCH_BYTES // 4))    # 4 large ones fill a batch
                event = seq.delta([round_], text, 0)
            durable = await events.publish(event, at_once=round_ == 1)
            published.append((event.run_id, event.sequence, durable))
        await asyncio.sleep(rng.choice((0.0, 0.004, 0.03)))
    positions = await asyncio.wait_for(asyncio.gather(*(durable for _, _, durable in published)), 20)
    assert len(set(positions)) == len(positions), "two events reported at one position"
    stored = await records_at(events, positions)
    by_run: dict[str, list[LogPosition]] = {}
    for (run_id, sequence, _), position in zip(published, positions, strict=True):
        assert (stored[position].run_id, stored[position].sequence) == (run_id, sequence), position
        by_run.setdefault(run_id, []).append(position)
    for run_positions in by_run.values():
        assert len({position.partition for position in run_positions}) == 1
        offsets = [position.offset for position in run_positions]
        assert offsets == sorted(offsets), "a run's events stored out of order"


async def test_a_full_batch_continues_in_a_second_batch_of_the_same_window_in_order(events):
    """One run, one window: 10 events of a quarter batch each (three fit a batch with its headers);
    the records go on in further batches of the same window and land contiguously, in order."""
    seq = RunEventSequencer(str(uuid.uuid4()))
    acks = [await events.publish(seq.delta([n], "y" * (BATCH_BYTES // 4), 0)) for n in range(10)]
    positions = await asyncio.wait_for(asyncio.gather(*acks), 10)
    first = positions[0].offset
    assert [position.offset for position in positions] == list(range(first, first + 10))
    stored = await records_at(events, positions)
    assert [stored[position].sequence for position in positions] == list(range(1, 11))


def broker_pid(broker: dict[str, str]) -> int:
    return int((Path(broker["SLUICE_PATHS__DATA_DIR"]) / "kafka" / "kafka.pid").read_text())


def _threads_running(pid: int) -> list[int]:
    """The threads of `pid` not (yet) stopped, from /proc (a thread exiting or gone meanwhile is not
    running)."""
    running = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state not in ("T", "t", "Z", "X"):
                running.append(int(task.name))
    return running


async def pause(pid: int, within_s: float = 5.0) -> None:
    """SIGSTOP `pid` and wait until every one of its threads has stopped. kill() returns before the
    stop has reached each thread: one running on the other CPU (a JVM has dozens) goes on for a
    moment, and a request sent right after could still be answered."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + within_s
    while running := _threads_running(pid):
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGCONT)
            raise AssertionError(f"threads {running} of {pid} still running {within_s} s after SIGSTOP")
        await asyncio.sleep(0.005)


def unanswered(future: asyncio.Future[LogPosition]) -> str:
    """What a future that should still be waiting holds (for an assertion's message)."""
    if not future.done():
        return "waiting"
    error = future.exception()
    return f"failed: {error!r}" if error is not None else f"answered: {future.result()}"


async def test_an_event_is_reported_durable_only_once_the_broker_acknowledged_it(broker, events):
    """With the broker paused (SIGSTOP) nothing it has not acknowledged resolves, a first token sent
    at once included, however long the linger is past; once it runs again each event gets its own
    position, in order."""
    seq = RunEventSequencer(str(uuid.uuid4()))
    warm = await events.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
    pid = broker_pid(broker)
    await pause(pid)
    try:
        first = await events.publish(seq.delta([1], "a", 0), at_once=True)
        later = await events.publish(seq.delta([2], "b", 0))
        await asyncio.sleep(1.0)     # ~70 lingers
        assert not first.done() and not later.done(), "reported durable while the broker was stopped"
    finally:
        os.kill(pid, signal.SIGCONT)
    positions = await asyncio.wait_for(asyncio.gather(first, later), 30)
    assert positions == [LogPosition(warm.partition, warm.offset + n) for n in (1, 2)]


async def test_closing_the_log_ships_the_open_window_and_resolves_every_event(events):
    seq = RunEventSequencer(str(uuid.uuid4()))
    acks = [await events.publish(seq.delta([n], "z", 0)) for n in range(3)]
    await events.close()
    assert all(ack.done() for ack in acks)
    offsets = [ack.result().offset for ack in acks]
    assert offsets == list(range(offsets[0], offsets[0] + 3))


async def produce_requests(counter: RequestCounter, at_least: int) -> int:
    """Produce requests logged since counter.mark() once `at_least` are in (the broker logs a request
    once its response is sent: the last line may follow the ack), plus any that follow shortly."""
    for _ in range(50):
        if counter.counts().get("produce", 0) >= at_least:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)
    return counter.counts().get("produce", 0)


def runs_over_partitions(partitions: list[int], runs_each: int) -> list[str]:
    """Run ids whose events land in each of `partitions`, `runs_each` per partition."""
    wanted = {partition: runs_each for partition in partitions}
    found: list[str] = []
    while any(wanted.values()):
        run_id = str(uuid.uuid4())
        partition = int(DefaultPartitioner()(run_id.encode(), partitions, partitions))
        if wanted[partition]:
            wanted[partition] -= 1
            found.append(run_id)
    return found


async def test_the_events_of_every_run_published_within_one_linger_leave_in_one_produce_request(broker):
    async with lingering_log(broker, 400) as events:
        partitions = sorted(await (await events._ready_producer()).partitions_for(events.topic))
        assert len(partitions) > 1, "the point is a request carrying several partitions"
        counter = RequestCounter(Path(broker["SLUICE_PATHS__DATA_DIR"]) / "logs" / "kafka.log")
        sequencers = [RunEventSequencer(run_id) for run_id in runs_over_partitions(partitions, 3)]
        counter.mark()
        # Each run's event 20 ms after the previous run's: ~240 ms in all, within the 400 ms linger
        # that the first one opened. One window, so one produce request to the one broker carries
        # every partition's batch (a linger per partition's batch would send one as each ends).
        acks = []
        for seq in sequencers:
            acks.append(await events.publish(seq.status(common_pb2.RUN_STATUS_RUNNING, 0)))
            await asyncio.sleep(0.02)
        await asyncio.wait_for(asyncio.gather(*acks), 10)
        assert await produce_requests(counter, 1) == 1


async def test_terminal_events_appended_close_together_leave_in_one_produce_request(broker):
    """append() (a terminal event, a fence) joins the open window, not at once, and the window leaves
    no later than the append's bound (400 ms here), however long the linger (3 s): the runs that end
    within it share one produce request (at once, each end took a request of its own), and each append
    still resolves with its own record's position, right after its run's last."""
    async with lingering_log(broker, 3000, append_within_ms=400) as events:
        partitions = sorted(await (await events._ready_producer()).partitions_for(events.topic))
        counter = RequestCounter(Path(broker["SLUICE_PATHS__DATA_DIR"]) / "logs" / "kafka.log")
        sequencers = [RunEventSequencer(run_id) for run_id in runs_over_partitions(partitions, 2)]
        # Each run's first event, every partition's leader known, nothing of theirs left in a window.
        firsts = await asyncio.wait_for(asyncio.gather(*[
            await events.publish(seq.status(common_pb2.RUN_STATUS_RUNNING, 0), at_once=True)
            for seq in sequencers]), 10)
        await asyncio.sleep(0.3)      # the broker logs a request after its answer: theirs are all in
        counter.mark()
        ends = []
        for seq in sequencers:        # one run ends every 20 ms: ~160 ms in all, within the bound
            terminal = seq.terminal(common_pb2.RUN_STATUS_COMPLETED, common_pb2.TokenUsage(), "", 0)
            ends.append(asyncio.ensure_future(events.append(terminal)))
            await asyncio.sleep(0.02)
        positions = await asyncio.wait_for(asyncio.gather(*ends), 1.5)    # half the linger
        # Each partition's terminals follow its runs' first events, in the order they were appended.
        following = {first.partition: first.offset + 1 for first in sorted(firsts, key=lambda p: p.offset)}
        expected = []
        for first in firsts:
            expected.append(LogPosition(first.partition, following[first.partition]))
            following[first.partition] += 1
        assert positions == expected
        assert await produce_requests(counter, 1) == 1


async def test_an_append_ends_a_window_that_a_plain_publish_opened_by_its_own_bound(broker):
    """A DELTA opened the window with the linger (3 s); a terminal event appended after it ends that
    window within the append's bound (200 ms), and both leave in one request, in order."""
    async with lingering_log(broker, 3000, append_within_ms=200) as events:
        seq = RunEventSequencer(str(uuid.uuid4()))
        await events.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))    # its partition's leader known
        await asyncio.sleep(0.3)
        counter = RequestCounter(Path(broker["SLUICE_PATHS__DATA_DIR"]) / "logs" / "kafka.log")
        counter.mark()
        delta = await events.publish(seq.delta([1], "a", 0))
        terminal = await asyncio.wait_for(
            events.append(seq.terminal(common_pb2.RUN_STATUS_COMPLETED, common_pb2.TokenUsage(), "", 0)), 1.5)
        assert delta.done() and terminal == LogPosition(delta.result().partition, delta.result().offset + 1)
        assert await produce_requests(counter, 1) == 1


async def test_a_first_token_sends_the_whole_open_window_at_once(broker):
    """At once means the window leaves now, every partition of it: one request, no linger waited."""
    async with lingering_log(broker, 3000) as events:
        partitions = sorted(await (await events._ready_producer()).partitions_for(events.topic))
        counter = RequestCounter(Path(broker["SLUICE_PATHS__DATA_DIR"]) / "logs" / "kafka.log")
        others = [RunEventSequencer(run_id) for run_id in runs_over_partitions(partitions, 2)]
        first = RunEventSequencer(str(uuid.uuid4()))
        counter.mark()
        acks = [await events.publish(seq.status(common_pb2.RUN_STATUS_RUNNING, 0)) for seq in others]
        acks.append(await events.publish(first.delta([7], "x", 0), at_once=True))
        await asyncio.wait_for(asyncio.gather(*acks), 1.5)    # half the linger
        assert await produce_requests(counter, 1) == 1


TOO_LARGE = 1_100_000   # bytes: over the producer's max_request_size (1 MiB) and the broker's limit


async def test_an_event_too_large_for_a_request_is_refused_at_publish_and_the_run_goes_on(events):
    """Refused before anything is sent (as send() refuses it): a batch the broker refused would have
    taken sequence numbers, and the partition's next batch would fail out of order. The run's next
    record lands right after the last one written."""
    seq = RunEventSequencer(str(uuid.uuid4()))
    written = await events.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
    too_large = seq.delta([1], "x" * TOO_LARGE, 0)
    with pytest.raises(MessageSizeTooLargeError):
        await events.publish(too_large, at_once=True)
    after = await asyncio.wait_for(events.append(seq.delta([2], "z", 0)), 10)
    assert after == LogPosition(written.partition, written.offset + 1)


async def test_a_window_due_while_its_broker_owes_an_answer_leaves_in_one_request_with_the_answered_partition(
        broker):
    """A broker answers one produce request of a producer at a time. A window that ends while it owes
    one waits for that answer, then all of it leaves in one request: the partition that was answered
    too, not alone right after the others (which sent each busy partition's batch as its own request)."""
    async with lingering_log(broker, 3000) as events:
        partitions = sorted(await (await events._ready_producer()).partitions_for(events.topic))
        busy, *others = [RunEventSequencer(run_id) for run_id in runs_over_partitions(partitions, 1)]
        counter = RequestCounter(Path(broker["SLUICE_PATHS__DATA_DIR"]) / "logs" / "kafka.log")
        counter.mark()
        for seq in (busy, *others):                 # every partition's leader known, producer warm
            await events.append(seq.status(common_pb2.RUN_STATUS_RUNNING, 0))
        # The broker logs a request after its answer: the last of these could otherwise be logged only
        # after the broker is resumed, and be counted with the requests under test (seen: 3 == 2).
        await produce_requests(counter, len(partitions))
        pid = broker_pid(broker)
        await pause(pid)
        try:
            owed = await events.publish(busy.delta([1], "a", 0), at_once=True)   # unanswered meanwhile
            await asyncio.sleep(0.3)
            counter.mark()
            acks = [await events.publish(seq.delta([2], "b", 0)) for seq in (*others, busy)]
            acks.append(await events.publish(busy.delta([3], "c", 0), at_once=True))
            await asyncio.sleep(0.3)
            assert not owed.done(), f"the owed request, with its broker stopped: {unanswered(owed)}"
        finally:
            os.kill(pid, signal.SIGCONT)
        await asyncio.wait_for(asyncio.gather(owed, *acks), 30)
        # The owed request is logged once answered (after mark()): it and one more.
        assert await produce_requests(counter, 2) == 2
