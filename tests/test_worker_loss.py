"""Worker loss on the real stack (DESIGN.md "Worker loss"): a replica or a routing
process dies mid-run; the run ends INTERRUPTED from its durable events, settled
exactly once, never regenerated. Also: several routing processes take each run once,
and a cursor whose events retention deleted gets OUT_OF_RANGE."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import grpc.aio
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic, RecordsToDelete
from sluice.ledger.models import Run, RunStatus, UsageEntry
from sluice.services.routing.worker import DETAIL_DRIVER_LOST
from sluice_client.sdk import SluiceClient
from sqlalchemy import func, select

from sluice.eventlog.interface import CURSOR_PAST_RETENTION, LogPosition
from sluice.v1 import common_pb2, runs_pb2
from tests.support.ledger_factories import budget_row
from tests.support.replica_proc import kill_replica, start_replica, stop_replica
from tests.support.routing_stack import (
    REPLICA_SETTINGS,
    TEST_LEASE_SECONDS,
    Stack,
    collect,
    deltas_tokens,
    replica_tables,
    stream_with_fault,
)

pytestmark = pytest.mark.integration

PROMPT = "Tell me about sluice gates."


async def assert_settled_once_as_streamed(stack: Stack, run_id: str, input_tokens: int,
                                          events: list[runs_pb2.RunEvent]) -> None:
    """The usage entry, the budget and the terminal event all equal the tokens streamed."""
    terminal = events[-1]
    async with stack.sessionmaker() as session:
        query = select(UsageEntry).where(UsageEntry.run_id == uuid.UUID(run_id))
        entries = (await session.scalars(query)).all()
    assert len(entries) == 1
    assert entries[0].output_tokens == terminal.usage.output_tokens == deltas_tokens(events)
    budget = await budget_row(stack.sessionmaker, stack.tenant.id)
    assert (budget.reserved_tokens, budget.used_tokens) == (0, input_tokens + deltas_tokens(events))


async def test_seed_002_a_replica_killed_mid_stream_ends_the_run_interrupted_with_the_tokens_consumed(
        stack: Stack, replica_logs):
    doomed = await asyncio.to_thread(start_replica, "r9", replica_logs, REPLICA_SETTINGS)
    try:
        stack.config = stack.config.updated(replicas=replica_tables([doomed]))
        await stack.start_worker()
        async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
            run = await sdk.submit(PROMPT, max_output_tokens=500)
            events, ended_s = await stream_with_fault(sdk.stream(run.run_id), 15,
                                                      lambda: kill_replica(doomed))
    finally:
        await asyncio.to_thread(stop_replica, doomed)
    terminal = events[-1]
    assert terminal.status == common_pb2.RUN_STATUS_INTERRUPTED
    assert terminal.detail.startswith("replica r9 lost mid-stream")
    assert ended_s < 3.0
    assert 14 <= deltas_tokens(events) < 500
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    await assert_settled_once_as_streamed(stack, run.run_id, run.input_tokens, events)
    async with stack.sessionmaker() as session:  # nothing regenerated: no other run, no replay
        assert await session.scalar(select(func.count()).select_from(Run)) == 1
    assert (await stack.run_row(run.run_id)).status == RunStatus.INTERRUPTED


async def test_a_routing_process_killed_mid_run_loses_its_lease_and_the_run_ends_interrupted(stack: Stack):
    doomed = await asyncio.to_thread(stack.start_worker_process, "doomed")
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=500)
        events: list[runs_pb2.RunEvent] = []
        killed_at = 0.0
        owner = ""
        async for event in sdk.stream(run.run_id):
            events.append(event)
            if len(events) == 15:
                owner = str((await stack.run_row(run.run_id)).lease_owner)
                await asyncio.to_thread(doomed.kill)
                killed_at = time.monotonic()
                await stack.start_worker()  # a surviving routing process; its reaper takes over
        ended_s = time.monotonic() - killed_at
    terminal = events[-1]
    row = await stack.run_row(run.run_id)
    assert terminal.status == common_pb2.RUN_STATUS_INTERRUPTED
    assert owner.startswith("doomed:")
    assert terminal.detail == DETAIL_DRIVER_LOST.format(owner=owner) == row.detail
    # Lease + one reaper pass (every lease/2) + slack.
    assert ended_s < TEST_LEASE_SECONDS * 1.5 + 2.0
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    await assert_settled_once_as_streamed(stack, run.run_id, run.input_tokens, events)


async def test_accepted_runs_survive_a_routing_process_killed_before_taking_them(stack: Stack):
    doomed = await asyncio.to_thread(stack.start_worker_process, "doomed")
    await asyncio.to_thread(doomed.kill)
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        runs = [await sdk.submit(PROMPT, max_output_tokens=5) for _ in range(3)]
        await stack.start_worker()
        finals = [(await collect(sdk.stream(run.run_id)))[-1] for run in runs]
    assert [f.status for f in finals] == [common_pb2.RUN_STATUS_COMPLETED] * 3


async def test_three_routing_processes_take_each_of_40_runs_exactly_once(stack: Stack):
    await asyncio.to_thread(stack.start_worker_process, "w1")
    await asyncio.to_thread(stack.start_worker_process, "w2")
    await stack.start_worker()
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        runs = await asyncio.gather(*[sdk.submit(f"{PROMPT} #{i}", max_output_tokens=12) for i in range(40)])
        streams = await asyncio.gather(*[collect(sdk.stream(run.run_id)) for run in runs])
    for events in streams:
        assert [e.sequence for e in events] == list(range(1, len(events) + 1))
        assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED
        assert deltas_tokens(events) == 12
    async with stack.sessionmaker() as session:
        owners = (await session.scalars(select(Run.lease_owner))).all()
        entries = await session.scalar(select(func.count()).select_from(UsageEntry))
    assert entries == 40
    assert len({owner.split(":")[0] for owner in owners}) >= 2  # the work really was shared


async def test_a_cursor_whose_events_retention_deleted_gets_out_of_range(stack: Stack):
    topic = f"sluice.test-retention-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=stack.config.kafka.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
        await stack.use_topic(topic)
        runs_server = await stack.start_runs_server()
        await stack.start_worker()
        async with SluiceClient(runs_server.address, stack.tenant.api_key) as sdk, \
                SluiceClient(stack.address, stack.tenant.api_key) as submitter:
            run = await submitter.submit(PROMPT, max_output_tokens=5)
            events = await collect(sdk.stream(run.run_id))
            assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED
            # What retention does when a segment ages out: the log start offset moves past
            # the run's events (DeleteRecords moves it the same way, without waiting days).
            tp = TopicPartition(topic, 0)
            end = (await stack.events.read_durable(run.run_id, _first(await stack.run_row(run.run_id))))
            assert end  # the events were there
            await admin.delete_records({tp: RecordsToDelete(before_offset=-1)})
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(sdk.stream_once(run.run_id, after=2))
            still = await sdk.get_run(run.run_id)
    finally:
        await admin.delete_topics([topic])
        await admin.close()
    assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert caught.value.details() == CURSOR_PAST_RETENTION.format(run_id=run.run_id, after=2)
    assert still.status == common_pb2.RUN_STATUS_COMPLETED  # the ledger still knows the outcome


def _first(run: Run) -> LogPosition:
    assert run.event_partition is not None and run.event_first_offset is not None
    return LogPosition(run.event_partition, run.event_first_offset)


async def test_a_routing_process_told_to_stop_finishes_its_runs_before_exiting(stack: Stack):
    leaving = await asyncio.to_thread(stack.start_worker_process, "leaving")
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=250)  # 5 s: longer than the 3 s lease
        events: list[runs_pb2.RunEvent] = []
        stopping: asyncio.Task[None] | None = None
        async for event in sdk.stream(run.run_id):
            events.append(event)
            if len(events) == 10:
                stopping = asyncio.create_task(asyncio.to_thread(leaving.stop))  # SIGTERM
        assert stopping is not None
        await stopping
    assert events[-1].status == common_pb2.RUN_STATUS_COMPLETED
    assert deltas_tokens(events) == 250
    assert leaving.process.returncode == 0
