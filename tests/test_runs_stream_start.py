"""Where a Stream starts reading (services/runs.py): a Stream opened right after Submit, before any
routing worker took the run, is handed every event live and never reads the ledger a second time
for where the run's events start (issue 9: one lookup per stream, not two). Real PostgreSQL, Kafka
and a Triton replica."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc.aio
import pytest
from sluice.ledger.channels import EVENTS_CHANNEL
from sluice.ledger.models import Run, RunStatus
from sluice.ledger.runs_sql import EventStart
from sluice.services import runs as runs_module
from sluice.services.admission import add_admission_servicer
from sluice.services.admitted_here import RecentAdmissions
from sluice.services.notify import notify
from sluice.services.routing import run_ledger as run_ledger_module
from sluice.services.routing.run_ledger import SqlRunLedger
from sluice.services.runs import add_runs_servicer

from sluice.eventlog.kafka import KafkaEventLog
from sluice.v1 import admission_pb2, admission_pb2_grpc, common_pb2, runs_pb2, runs_pb2_grpc
from tests.support.routing_stack import RunsServer, Stack, collect, deltas_tokens

pytestmark = pytest.mark.integration

TOKENS = 6


async def until(condition: object, timeout_s: float = 30.0) -> None:  # generous: a box at load 20+
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def listening_runs_server(stack: Stack) -> RunsServer:
    """A Runs server of its own whose LISTEN for recorded starts is up (it is, once warm)."""
    runs = await stack.start_runs_server()
    assert runs.service._started is not None
    runs.service._started.start()
    await until(lambda: runs.service._started.listening)
    return runs


async def submit(stack: Stack, metadata: tuple[tuple[str, str], ...],
                 tokens: int = TOKENS) -> admission_pb2.SubmitResponse:
    return await admission_pb2_grpc.AdmissionStub(stack.channel).Submit(
        admission_pb2.SubmitRequest(model="chat", input=b"How does a lock chamber fill?",
                                    request_key=str(uuid.uuid4()), max_output_tokens=tokens),
        metadata=metadata)


def running_written_late(monkeypatch: pytest.MonkeyPatch, late_s: float) -> None:
    """Routing workers commit RUNNING `late_s` after they would."""
    write = SqlRunLedger._mark_running

    async def late(self: SqlRunLedger, marks: list[object]) -> list[bool]:
        await asyncio.sleep(late_s)
        return await write(self, marks)  # type: ignore[arg-type]

    monkeypatch.setattr(SqlRunLedger, "_mark_running", late)


@asynccontextmanager
async def told_first_event_live(stack: Stack, tokens: int = TOKENS) -> AsyncIterator[
        tuple[grpc.aio.UnaryStreamCall[runs_pb2.StreamRequest, runs_pb2.RunEvent], runs_pb2.RunEvent, Run]]:
    """A run submitted and streamed live from before any worker runs; yields the stream, the first
    event the client got and the run's row read the moment it got it."""
    runs = await listening_runs_server(stack)
    metadata = (("x-api-key", stack.tenant.api_key),)
    run = await submit(stack, metadata, tokens)
    async with grpc.aio.insecure_channel(runs.address) as channel:
        stream = runs_pb2_grpc.RunsStub(channel).Stream(runs_pb2.StreamRequest(run_id=run.run_id),
                                                         metadata=metadata)
        await until(lambda: runs.events.live_tail is not None and runs.events.live_tail.subscriptions == 1)
        await stack.start_worker()
        first = await asyncio.wait_for(stream.read(), 30)
        yield stream, first, await stack.run_row(run.run_id)


async def test_a_stream_opened_before_its_run_is_claimed_gets_every_event_without_reading_the_ledger_again(
        stack: Stack, monkeypatch: pytest.MonkeyPatch):
    # The ledger's slow re-poll (the safety net for lost notifications) must not fire while the
    # worker starts on a busy box: what is pinned here is that nothing reads it sooner.
    monkeypatch.setattr(runs_module, "WAIT_REPOLL_S", 120.0)
    runs = await listening_runs_server(stack)
    service = runs.service
    reads: list[uuid.UUID] = []
    read_ledger = service._event_start

    async def counted(run_id: uuid.UUID) -> EventStart:
        reads.append(run_id)
        return await read_ledger(run_id)

    service._event_start = counted  # type: ignore[method-assign]
    metadata = (("x-api-key", stack.tenant.api_key),)
    run = await submit(stack, metadata)
    async with grpc.aio.insecure_channel(runs.address) as channel:
        stream = runs_pb2_grpc.RunsStub(channel).Stream(runs_pb2.StreamRequest(run_id=run.run_id),
                                                         metadata=metadata)
        reading = asyncio.create_task(collect(stream))
        # No worker yet: the stream looked the run up (no start recorded) and waits on the live tail.
        await until(lambda: runs.events.live_tail is not None and runs.events.live_tail.subscriptions == 1)
        await stack.start_worker()
        events: list[runs_pb2.RunEvent] = await reading
    assert [event.sequence for event in events] == list(range(1, len(events) + 1))
    assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED
    assert deltas_tokens(events) == TOKENS == events[-1].usage.output_tokens
    assert reads == []


async def test_a_stream_hands_over_the_runs_first_event_only_once_the_ledger_has_committed_running(
        stack: Stack, monkeypatch: pytest.MonkeyPatch):
    """DESIGN.md: every transition is durable in PostgreSQL before it is acknowledged to anyone. The
    run's first event (STATUS RUNNING) is durable in Kafka before the worker commits RUNNING; here the
    worker writes RUNNING a second late, and the stream following the run live must hold its first
    event until then: whoever is told RUNNING then finds it in the ledger (GetRun, finance)."""
    running_written_late(monkeypatch, 1.0)
    async with told_first_event_live(stack) as (stream, first, row):
        told_running = row.status                      # read the moment the client is told
        rest = []
        while (event := await asyncio.wait_for(stream.read(), 30)) is not grpc.aio.EOF:
            rest.append(event)
    assert first.sequence == 1 and first.status == common_pb2.RUN_STATUS_RUNNING
    assert told_running in {RunStatus.RUNNING, RunStatus.COMPLETED}          # not still QUEUED
    assert [event.sequence for event in rest] == list(range(2, len(rest) + 2))
    assert rest[-1].status == common_pb2.RUN_STATUS_COMPLETED and deltas_tokens(rest) == TOKENS


async def test_a_stream_not_notified_of_running_hands_the_first_event_over_once_running_is_committed(
        stack: Stack, monkeypatch: pytest.MonkeyPatch):
    """The RUNNING hold waits for RUNNING, not for the start recorded after it. Here the RUNNING
    commit's NOTIFY goes to a channel nobody hears (so the stream reads the ledger after
    RUNNING_NOTIFIED_WITHIN_S) and the start is written 3 s late: the client must get the run's first
    event while the ledger holds RUNNING but no start yet (seen: held until the start, ~0.6 s at p95
    under load)."""
    monkeypatch.setattr(run_ledger_module, "EVENTS_CHANNEL", "sluice_test_heard_by_nobody")
    write = SqlRunLedger._record_starts

    async def late(self: SqlRunLedger, marks: list[object]) -> list[bool]:
        await asyncio.sleep(3.0)
        return await write(self, marks)  # type: ignore[arg-type]

    monkeypatch.setattr(SqlRunLedger, "_record_starts", late)
    async with told_first_event_live(stack, 200) as (stream, first, row):   # TOKEN_DELAY_MS apart: ~4 s
        stream.cancel()
    assert first.sequence == 1 and first.status == common_pb2.RUN_STATUS_RUNNING
    assert row.status == RunStatus.RUNNING              # durable before the client was told
    assert row.event_first_offset is None               # and not held for the start written later


async def test_a_stream_opened_after_running_is_committed_and_before_its_start_is_recorded_reads_it_soon(
        stack: Stack, monkeypatch: pytest.MonkeyPatch):
    """The worker commits RUNNING (and its NOTIFY) while the run's first events travel to the log and
    records where they start a moment later, with no NOTIFY of its own (ledger/runs_sql.py). A Stream
    that looks in between, once the first event went by, finds the run RUNNING without a start and
    re-reads the ledger shortly (runs.START_POLL_S), instead of waiting for a NOTIFY that is not coming
    (WAIT_REPOLL_S, made longer than the test here). The start is written 2 s late; the run lasts ~4 s."""
    monkeypatch.setattr(runs_module, "WAIT_REPOLL_S", 120.0)
    write = SqlRunLedger._record_starts

    async def late(self: SqlRunLedger, marks: list[object]) -> list[bool]:
        await asyncio.sleep(2.0)
        return await write(self, marks)  # type: ignore[arg-type]

    monkeypatch.setattr(SqlRunLedger, "_record_starts", late)
    tokens = 200                                        # TOKEN_DELAY_MS apart: ~4 s
    runs = await listening_runs_server(stack)
    metadata = (("x-api-key", stack.tenant.api_key),)
    run = await submit(stack, metadata, tokens)
    await stack.start_worker()
    await stack.wait_for_status(run.run_id, {RunStatus.RUNNING}, timeout_s=30)
    await asyncio.sleep(0.3)                            # its first events durable, and gone by live
    row = await stack.run_row(run.run_id)
    assert (row.status, row.event_first_offset) == (RunStatus.RUNNING, None)    # the window under test
    async with grpc.aio.insecure_channel(runs.address) as channel:
        stream = runs_pb2_grpc.RunsStub(channel).Stream(runs_pb2.StreamRequest(run_id=run.run_id),
                                                         metadata=metadata)
        events = await asyncio.wait_for(collect(stream), 60)
    assert [event.sequence for event in events] == list(range(1, len(events) + 1))
    assert events[0].status == common_pb2.RUN_STATUS_RUNNING
    assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED and deltas_tokens(events) == tokens


async def test_the_first_stream_of_a_run_admitted_by_the_same_process_and_key_skips_the_ledger_lookup(
        stack: Stack, monkeypatch: pytest.MonkeyPatch):
    """services/admitted_here.py: Submit and Stream through one gateway, sharing what Submit knew.
    Its first Stream with the submitting key reads no ledger at all; a second Stream of it, or a Stream
    with another key, looks the run up as any Stream does (another tenant's: NOT_FOUND)."""
    lookups: list[uuid.UUID | None] = []
    looked_up = runs_module.stream_lookup

    async def counted(connection: object, key: str, run_id: uuid.UUID | None) -> object:
        lookups.append(run_id)
        return await looked_up(connection, key, run_id)  # type: ignore[arg-type]

    monkeypatch.setattr(runs_module, "stream_lookup", counted)
    events = KafkaEventLog(stack.config.kafka.bootstrap, stack.events.topic)
    await events.start()
    admitted = RecentAdmissions()
    server = grpc.aio.server()
    admission = add_admission_servicer(server, stack.sessionmaker, stack.config, recent=admitted)
    runs = add_runs_servicer(server, stack.sessionmaker, stack.config, events, admitted=admitted)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await stack.start_worker()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            metadata = (("x-api-key", stack.tenant.api_key),)
            run = await admission_pb2_grpc.AdmissionStub(channel).Submit(
                admission_pb2.SubmitRequest(model="chat", input=b"How does a lock chamber fill?",
                                            request_key=str(uuid.uuid4()), max_output_tokens=TOKENS),
                metadata=metadata)
            stub = runs_pb2_grpc.RunsStub(channel)
            first = await collect(stub.Stream(runs_pb2.StreamRequest(run_id=run.run_id), metadata=metadata))
            assert lookups == []
            assert [event.sequence for event in first] == list(range(1, len(first) + 1))
            assert first[-1].status == common_pb2.RUN_STATUS_COMPLETED
            assert deltas_tokens(first) == TOKENS
            again = await collect(stub.Stream(runs_pb2.StreamRequest(run_id=run.run_id, after=1),
                                              metadata=metadata))
            assert lookups == [uuid.UUID(run.run_id)]
            assert [event.sequence for event in again] == [event.sequence for event in first[1:]]

            run = await admission_pb2_grpc.AdmissionStub(channel).Submit(
                admission_pb2.SubmitRequest(model="chat", input=b"And how does it empty?",
                                            request_key=str(uuid.uuid4()), max_output_tokens=TOKENS),
                metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(stub.Stream(runs_pb2.StreamRequest(run_id=run.run_id),
                                          metadata=(("x-api-key", stack.other.api_key),)))
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            assert lookups[-1] == uuid.UUID(run.run_id)
    finally:
        await server.stop(None)
        await runs.close()
        await admission.close()
        await events.close()


async def test_the_first_stream_of_a_run_admitted_here_opened_after_its_running_notify_does_not_wait_for_it(
        stack: Stack, monkeypatch: pytest.MonkeyPatch):
    """A run admitted by this process: its first Stream skips the lookup and waits for the NOTIFY of
    the run's start, registered only when the client opens it. With a replica that answers within
    milliseconds the NOTIFY may come first; the process heard it (runs.NOTIFIED_REMEMBERED), so the
    stream does not wait for it. The waits a missed NOTIFY falls back to are raised to a minute here:
    the first event must come within seconds."""
    monkeypatch.setattr(runs_module, "ADMITTED_HERE_WAIT_S", 60.0)
    monkeypatch.setattr(runs_module, "RUNNING_NOTIFIED_WITHIN_S", 60.0)
    monkeypatch.setattr(runs_module, "WAIT_REPOLL_S", 120.0)
    events = KafkaEventLog(stack.config.kafka.bootstrap, stack.events.topic)
    await events.start()
    admitted = RecentAdmissions(fresh_s=60.0)       # the Stream below comes well after its Submit
    server = grpc.aio.server()
    admission = add_admission_servicer(server, stack.sessionmaker, stack.config, recent=admitted)
    runs = add_runs_servicer(server, stack.sessionmaker, stack.config, events, admitted=admitted)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    listener = runs._started
    assert listener is not None
    listener.start()
    try:
        await until(lambda: listener.listening)
        await stack.start_worker()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            metadata = (("x-api-key", stack.tenant.api_key),)
            run = await admission_pb2_grpc.AdmissionStub(channel).Submit(
                admission_pb2.SubmitRequest(model="chat", input=b"How does a lock chamber fill?",
                                            request_key=str(uuid.uuid4()), max_output_tokens=200),
                metadata=metadata)
            await until(lambda: listener.heard(run.run_id))          # RUNNING's NOTIFY went by
            stream = runs_pb2_grpc.RunsStub(channel).Stream(runs_pb2.StreamRequest(run_id=run.run_id),
                                                             metadata=metadata)
            first = await asyncio.wait_for(stream.read(), 20)
            assert first.sequence == 1 and first.status == common_pb2.RUN_STATUS_RUNNING
            stream.cancel()
    finally:
        await server.stop(None)
        await runs.close()
        await admission.close()
        await events.close()


async def test_the_running_hold_does_not_wait_for_a_notify_heard_before_it_began(
        stack: Stack, monkeypatch: pytest.MonkeyPatch):
    """The hold on a run's first event (RUNNING durable before anyone is told) trusts a NOTIFY of the
    run that this process heard before the stream's waiter existed: no ledger read, no wait."""
    monkeypatch.setattr(runs_module, "RUNNING_NOTIFIED_WITHIN_S", 60.0)
    runs = await listening_runs_server(stack)
    service = runs.service
    assert service._started is not None
    run_id = uuid.uuid4()
    with service._started.waiter(str(run_id)) as delivered:
        async with stack.sessionmaker() as session:
            await notify(session, EVENTS_CHANNEL, str(run_id))
            await session.commit()
        await asyncio.wait_for(delivered.wait(), 30)
    reads: list[uuid.UUID] = []

    async def counted(read_id: uuid.UUID) -> EventStart:
        reads.append(read_id)
        return EventStart(None, None, None)

    service._event_start = counted  # type: ignore[method-assign]
    await asyncio.wait_for(service._running_recorded(run_id, asyncio.Event()), 5)
    assert reads == []
    # A run nobody notified waits for its NOTIFY (here: the minute), as before.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(service._running_recorded(uuid.uuid4(), asyncio.Event()), 1)


async def test_a_stream_opened_after_its_runs_first_events_went_by_live_still_waits_for_running(
        stack: Stack, monkeypatch: pytest.MonkeyPatch):
    """A stream that subscribes after its run's first events reached the process's live tail is
    served from the records the tail holds (eventlog/kafka.py follow_from_first), and still hands the
    first one over only once the ledger has committed RUNNING, written here 1.5 s late."""
    running_written_late(monkeypatch, 1.5)
    runs = await listening_runs_server(stack)
    metadata = (("x-api-key", stack.tenant.api_key),)
    async with grpc.aio.insecure_channel(runs.address) as channel:
        stub = runs_pb2_grpc.RunsStub(channel)
        # Another run's stream has the tail follow the topic's partitions (every one: no home here).
        other = await submit(stack, metadata, 1)
        following = stub.Stream(runs_pb2.StreamRequest(run_id=other.run_id), metadata=metadata)
        await until(lambda: runs.events.live_tail is not None and runs.events.live_tail.subscriptions == 1)
        run = await submit(stack, metadata)
        await stack.start_worker()
        partition = await runs.events.partition_of(run.run_id)
        tail = runs.events.live_tail
        assert tail is not None
        await until(lambda: len(tail.held(run.run_id, partition)) >= 2)      # STATUS and a DELTA
        assert (await stack.run_row(run.run_id)).status == RunStatus.QUEUED  # RUNNING not yet written
        events = []
        async for event in stub.Stream(runs_pb2.StreamRequest(run_id=run.run_id), metadata=metadata):
            if not events:
                told = await stack.run_row(run.run_id)       # read the moment the client is told
            events.append(event)
        following.cancel()
    assert told.status in {RunStatus.RUNNING, RunStatus.COMPLETED}            # not still QUEUED
    assert [event.sequence for event in events] == list(range(1, len(events) + 1))
    assert events[0].status == common_pb2.RUN_STATUS_RUNNING
    assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED and deltas_tokens(events) == TOKENS
