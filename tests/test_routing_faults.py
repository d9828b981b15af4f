"""Faults on the real stack that must interrupt nothing healthy, and a hung replica that must be
noticed quickly (issue 10.1, 10.4): a SIGSTOPped replica's run ends INTERRUPTED within 5 s with
exactly the tokens it streamed; a burst of concurrent runs on a healthy stack loses no lease; a
PostgreSQL outage shorter than the lease (a cuttable proxy in front of the shared server, which is
never restarted) interrupts no run in progress."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import pytest
from sluice.ledger.db import make_engine, make_sessionmaker
from sluice.ledger.models import RunStatus, UsageEntry
from sluice.services.routing.app import policy_from_config, registry_from_config
from sluice.services.routing.worker import RoutingWorker, WorkerSettings, new_owner_id
from sluice_client.sdk import SluiceClient
from sqlalchemy import select

from sluice.v1 import common_pb2
from tests.support.ledger_factories import budget_row
from tests.support.replica_proc import kill_replica, start_replica
from tests.support.routing_stack import (
    REPLICA_SETTINGS,
    Stack,
    collect,
    deltas_tokens,
    replica_tables,
    stream_with_fault,
)
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.integration

PROMPT = "Tell me about sluice gates."
HUNG_DETECTED_WITHIN_S = 5.0


async def test_a_sigstopped_replica_ends_its_run_interrupted_within_5_s_with_exactly_the_tokens_streamed(
        stack: Stack, replica_logs):
    frozen = await asyncio.to_thread(start_replica, "r-stop", replica_logs, REPLICA_SETTINGS)
    try:
        stack.config = stack.config.updated(replicas=replica_tables([frozen]))
        await stack.start_worker()
        async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
            run = await sdk.submit(PROMPT, max_output_tokens=500)
            # Alive and silent: the host, its tritonserver and the model stub all stopped.
            events, ended_s = await stream_with_fault(
                sdk.stream(run.run_id), 15, lambda: os.killpg(frozen.process.pid, signal.SIGSTOP))
    finally:
        os.killpg(frozen.process.pid, signal.SIGCONT)
        await asyncio.to_thread(kill_replica, frozen)
    terminal = events[-1]
    assert terminal.status == common_pb2.RUN_STATUS_INTERRUPTED
    assert terminal.detail.startswith("replica r-stop stopped answering after")
    assert ended_s <= HUNG_DETECTED_WITHIN_S
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    streamed = deltas_tokens(events)
    assert 14 <= streamed < 500 and terminal.usage.output_tokens == streamed
    async with stack.sessionmaker() as session:
        query = select(UsageEntry).where(UsageEntry.run_id == uuid.UUID(run.run_id))
        entries = (await session.scalars(query)).all()
    assert [e.output_tokens for e in entries] == [streamed]


async def test_a_burst_of_60_concurrent_runs_on_a_healthy_stack_interrupts_none(stack: Stack):
    await stack.start_worker()
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        runs = await asyncio.gather(*[sdk.submit(f"{PROMPT} #{i}", max_output_tokens=40) for i in range(60)])
        streams = await asyncio.gather(*[collect(sdk.stream(run.run_id), timeout_s=90) for run in runs])
    statuses = [common_pb2.RunStatus.Name(events[-1].status) for events in streams]
    assert statuses == ["RUN_STATUS_COMPLETED"] * 60
    assert all(deltas_tokens(events) == 40 for events in streams)


async def test_a_database_outage_shorter_than_the_lease_interrupts_no_run(stack: Stack):
    # The worker reaches PostgreSQL only through the proxy: its pool, its lease keeper, its LISTENs.
    proxy, proxied = await TcpProxy.before_database(stack.config.database.url)
    engine = make_engine(proxied)
    worker = RoutingWorker(WorkerSettings.from_config(stack.config, new_owner_id("blip")),
                           make_sessionmaker(engine), stack.events,
                           policy_from_config(stack.config),
                           registry_from_config(stack.config), dsn=proxied)
    serving = asyncio.create_task(worker.serve(drain_s=0.5))
    try:
        async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
            runs = await asyncio.gather(*[sdk.submit(f"{PROMPT} #{i}", max_output_tokens=150)
                                          for i in range(8)])
            streams = [asyncio.create_task(collect(sdk.stream(run.run_id), timeout_s=60)) for run in runs]
            for run in runs:                              # every run streaming (150 tokens: 3 s each)
                await stack.wait_for_status(run.run_id, {RunStatus.RUNNING})
            await proxy.cut(0.8)                          # connections reset, new ones refused, for 0.8 s
            results = await asyncio.gather(*streams)
    finally:
        worker.stop()
        await serving
        await engine.dispose()
        await proxy.close()
    assert proxy.cuts == 1
    endings = [(common_pb2.RunStatus.Name(events[-1].status), events[-1].detail) for events in results]
    assert endings == [("RUN_STATUS_COMPLETED", "")] * 8
    assert all(deltas_tokens(events) == 150 for events in results)
    budget = await budget_row(stack.sessionmaker, stack.tenant.id)
    assert budget.reserved_tokens == 0                     # every run settled
