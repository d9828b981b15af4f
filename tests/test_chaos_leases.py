"""Leases on the real stack (DESIGN.md "Leases and fencing", issue 9 point 6): a routing worker whose
PostgreSQL stalls, answers every statement late, or whose event loop is kept busy, for less than a
lease interrupts no run, and every
run completes with exactly its tokens; a stall longer than the lease ends the runs INTERRUPTED from
their last durable event (reaped behind a fence), never regenerated: each client's events stop at a
sequence it saw, followed by the terminal event that records the interruption.

The worker reaches PostgreSQL through a proxy that holds every byte for the stall (nothing is reset,
nothing answers); Kafka and the replicas carry on. `make test` runs 4 runs per fault, and only the
busy loop and the stall longer than the lease: the shorter stall and the late answers run in `make
chaos` (SLUICE_CHAOS=1, 16 runs per fault), their lease keeper's counterparts without the stack in
test_lease_faults.py in `make test`.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from sluice.ledger.models import RunStatus, UsageEntry
from sluice.services.routing.worker import DETAIL_DRIVER_LOST
from sluice_client.sdk import SluiceClient
from sqlalchemy import select

from sluice.v1 import common_pb2, runs_pb2
from tests.support.chaos import FULL, full_only
from tests.support.ledger_factories import budget_row
from tests.support.routing_stack import (
    TEST_LEASE_SECONDS,
    Stack,
    collect,
    deltas_tokens,
    proxied_worker,
)

pytestmark = pytest.mark.integration

PROMPT = "Tell me about sluice gates."
RUNS = 16 if FULL else 4
TOKENS = 500                     # at TOKEN_DELAY_MS (20 ms): 10 s per run. A run must outlast the wait for
                                 #   every run to be RUNNING plus the longest fault (1.5 leases): at 5 s,
                                 #   on a loaded box the runs ended before their lease did (COMPLETED,
                                 #   settled after the stall: correct, but not the fault under test)
COMPLETED = common_pb2.RUN_STATUS_COMPLETED
INTERRUPTED = common_pb2.RUN_STATUS_INTERRUPTED


Streams = list[asyncio.Task[list[runs_pb2.RunEvent]]]


async def streaming(stack: Stack, sdk: SluiceClient) -> tuple[list[str], Streams]:
    """RUNS runs submitted, each streamed by a client, once every one is RUNNING."""
    runs = await asyncio.gather(*[sdk.submit(f"{PROMPT} #{i}", max_output_tokens=TOKENS)
                                  for i in range(RUNS)])
    streams = [asyncio.create_task(collect(sdk.stream(run.run_id), timeout_s=90)) for run in runs]
    for run in runs:
        await stack.wait_for_status(run.run_id, {RunStatus.RUNNING})
    return [run.run_id for run in runs], streams


def contiguous(events: list[runs_pb2.RunEvent]) -> bool:
    """1, 2, ... n, one RUNNING status (the run was generated once), the TERMINAL last."""
    running = [e for e in events if e.type == runs_pb2.EVENT_TYPE_STATUS
               and e.status == common_pb2.RUN_STATUS_RUNNING]
    return ([e.sequence for e in events] == list(range(1, len(events) + 1)) and len(running) == 1
            and events[-1].type == runs_pb2.EVENT_TYPE_TERMINAL)


async def assert_settled_once_as_streamed(stack: Stack, run_ids: list[str],
                                          streams: list[list[runs_pb2.RunEvent]]) -> None:
    async with stack.sessionmaker() as session:
        for run_id, events in zip(run_ids, streams, strict=True):
            query = select(UsageEntry).where(UsageEntry.run_id == uuid.UUID(run_id))
            entries = (await session.scalars(query)).all()
            assert [e.output_tokens for e in entries] == [deltas_tokens(events)]
            assert events[-1].usage.output_tokens == deltas_tokens(events)
    budget = await budget_row(stack.sessionmaker, stack.tenant.id)
    assert budget.reserved_tokens == 0


@full_only
async def test_a_database_stall_shorter_than_the_lease_interrupts_no_run(stack: Stack):
    async with proxied_worker(stack) as (proxy, _), SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run_ids, streams = await streaming(stack, sdk)
        await proxy.stall(0.7 * TEST_LEASE_SECONDS)
        results = await asyncio.gather(*streams)
    assert proxy.stalls == 1
    assert [(e[-1].status, e[-1].detail) for e in results] == [(COMPLETED, "")] * RUNS
    assert [deltas_tokens(e) for e in results] == [TOKENS] * RUNS and all(map(contiguous, results))
    await assert_settled_once_as_streamed(stack, run_ids, results)


@full_only
async def test_a_database_answering_late_but_within_the_lease_interrupts_no_run(stack: Stack):
    # Every answer to the worker 0.4 of a lease late (a database on a saturated box) for two leases:
    # renewals land late but within the lease; nothing cuts them short.
    async with proxied_worker(stack) as (proxy, _), SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run_ids, streams = await streaming(stack, sdk)
        proxy.slow(0.4 * TEST_LEASE_SECONDS)
        await asyncio.sleep(2 * TEST_LEASE_SECONDS)
        proxy.slow(0.0)
        results = await asyncio.gather(*streams)
    assert [(e[-1].status, e[-1].detail) for e in results] == [(COMPLETED, "")] * RUNS
    assert [deltas_tokens(e) for e in results] == [TOKENS] * RUNS and all(map(contiguous, results))
    await assert_settled_once_as_streamed(stack, run_ids, results)


async def test_a_routing_loop_busy_for_most_of_a_lease_interrupts_no_run(stack: Stack):
    await stack.start_worker()           # on this test's event loop: busy below means busy there
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run_ids, streams = await streaming(stack, sdk)
        busy_until = time.monotonic() + 0.6 * TEST_LEASE_SECONDS
        while time.monotonic() < busy_until:      # token work that never yields to the loop
            pass
        results = await asyncio.gather(*streams)
    assert [(e[-1].status, e[-1].detail) for e in results] == [(COMPLETED, "")] * RUNS
    assert [deltas_tokens(e) for e in results] == [TOKENS] * RUNS and all(map(contiguous, results))
    await assert_settled_once_as_streamed(stack, run_ids, results)


async def test_a_database_stall_longer_than_the_lease_ends_runs_interrupted_never_regenerated(stack: Stack):
    async with proxied_worker(stack) as (proxy, worker), \
            SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run_ids, streams = await streaming(stack, sdk)
        await proxy.stall(1.5 * TEST_LEASE_SECONDS)
        results = await asyncio.gather(*streams)
    detail = DETAIL_DRIVER_LOST.format(owner=worker.settings.owner)
    assert [(e[-1].status, e[-1].detail) for e in results] == [(INTERRUPTED, detail)] * RUNS
    assert all(map(contiguous, results))              # the events stop at a sequence the client saw
    streamed = [deltas_tokens(e) for e in results]
    assert all(0 < tokens < TOKENS for tokens in streamed), streamed   # cut short, not regenerated
    await assert_settled_once_as_streamed(stack, run_ids, results)
