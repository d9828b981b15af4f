"""The fault suite on the shared stack (PostgreSQL :54329, Kafka :19092, Triton replicas): load,
a fault of the processes Sluice runs, then the ledger invariants (tests/support/chaos.py).

Quick scenarios run in `make test`; those marked `full_only` run in `make chaos` (SLUICE_CHAOS=1),
with the infrastructure faults of tests/test_chaos_infra.py.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest
from sluice.ledger.models import TERMINAL_STATUSES, Run, RunStatus
from sluice_client.sdk import SluiceClient
from sqlalchemy import select

from sluice.config import load_settings
from tests.support.chaos import (
    FULL,
    RESULTS,
    ChaosResult,
    Load,
    conclude,
    during,
    expect_no_healthy_run_interrupted,
    full_only,
    lease_violations,
    load_average,
)
from tests.support.replica_proc import ReplicaProcess, kill_replica, start_replica, stop_replica
from tests.support.routing_stack import REPLICA_SETTINGS, TEST_LEASE_SECONDS, Stack, replica_tables

pytestmark = pytest.mark.integration

PROMPT = "Explain how a canal lock raises a boat"
# Issue 10's count: 0 healthy runs INTERRUPTED across 10 bursts of 100 (make chaos); make test: 2 x 20.
BURSTS, BURST = (10, 100) if FULL else (2, 20)


def assert_clean(result: ChaosResult) -> None:
    assert result.passed, "\n".join(result.violations[:10])


async def test_bursts_of_concurrent_runs_complete_every_run_and_keep_the_ledger_exact(stack: Stack):
    # The configured lease, not the stack's shortened one: the count is about what ships.
    stack.config = stack.config.updated(routing={"lease_seconds": load_settings().routing.lease_seconds})
    await stack.start_worker()
    results = []
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        for burst in range(1, BURSTS + 1):
            started = time.monotonic()
            load = Load(stack)
            await load.submit(sdk, BURST, 16, PROMPT)
            result = await conclude(ChaosResult(f"burst {burst}/{BURSTS} of {BURST} concurrent runs"), load,
                                    started, stream_timeout_s=120)
            result.note = (f"INTERRUPTED {result.statuses[RunStatus.INTERRUPTED]} of {result.runs};"
                           f" lease {stack.config.routing.lease_seconds:g} s; load {load_average()}")
            results.append(result)
    interrupted = sum(result.statuses[RunStatus.INTERRUPTED] for result in results)
    summary = ChaosResult(f"{BURSTS} bursts of {BURST}: healthy runs INTERRUPTED",
                          runs=sum(result.runs for result in results),
                          statuses=sum((result.statuses for result in results), collections.Counter()),
                          violations=[v for result in results for v in result.violations],
                          seconds=sum(result.seconds for result in results),
                          note=f"{interrupted} of {BURSTS * BURST}")
    RESULTS.append(summary)
    for result in results:
        assert_clean(result)
        expect_no_healthy_run_interrupted(result)
        assert result.statuses == {RunStatus.COMPLETED: BURST}


async def test_cancel_racing_completion_ends_each_run_once_either_way(stack: Stack):
    await stack.start_worker()
    started = time.monotonic()
    load = Load(stack)
    rng = random.Random(7)
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run_ids = await load.submit(sdk, 16, 8, PROMPT)

        async def cancel_near_the_end(run_id: str) -> None:
            # 8 tokens at ~20 ms each: cancel somewhere around the last tokens and the terminal.
            await asyncio.sleep(rng.uniform(0.05, 0.5))
            await sdk.cancel(run_id)

        await asyncio.gather(*(cancel_near_the_end(run_id) for run_id in run_ids))
        result = await conclude(ChaosResult("cancel racing completion"), load, started)
    assert_clean(result)
    expect_no_healthy_run_interrupted(result)
    assert set(result.statuses) <= {RunStatus.COMPLETED, RunStatus.CANCELLED}
    assert sum(result.statuses.values()) == 16


async def test_clients_that_disconnect_mid_stream_resume_exactly(stack: Stack):
    await stack.start_worker()
    started = time.monotonic()
    load = Load(stack)
    dropped: list[str] = []
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=40)
        load.run_ids.append(run.run_id)
        for _ in range(4):   # drop the connection four times, each after a few events
            call = sdk.stream_once(run.run_id, after=len(load.streams.get(run.run_id, [])))
            events = load.streams.setdefault(run.run_id, [])
            async for event in call:
                events.append(event)
                if len(events) % 3 == 0:
                    call.cancel()
                    dropped.append(run.run_id)
                    break
        async for event in sdk.stream(run.run_id, after=len(load.streams[run.run_id])):
            load.streams[run.run_id].append(event)
        result = await conclude(ChaosResult("client disconnects and resumes"), load, started)
    result.note = f"{len(dropped)} disconnects"
    assert_clean(result)
    expect_no_healthy_run_interrupted(result)
    assert result.statuses == {RunStatus.COMPLETED: 1}


async def _replica_fault(stack: Stack, replica_logs, name: str, runs: int,
                        fault: Callable[[ReplicaProcess, Load], Awaitable[str]]) -> ChaosResult:
    """`runs` long runs on a replica of their own; 1.5 s in, `fault` (which returns the note)."""
    replica = await asyncio.to_thread(start_replica, f"chaos-{name.split()[-1].lower()}", replica_logs,
                                      REPLICA_SETTINGS)
    try:
        stack.config = stack.config.updated(replicas=replica_tables([replica]))
        await stack.start_worker()
        started = time.monotonic()
        load = Load(stack)
        async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
            await load.submit(sdk, runs, 400, PROMPT)
            await asyncio.sleep(1.5)
            note = await fault(replica, load)
            result = await conclude(ChaosResult(name), load, started)
    finally:
        await asyncio.to_thread(stop_replica, replica)
    result.note = note
    return result


async def test_a_replica_killed_under_load_interrupts_only_its_runs(stack: Stack, replica_logs):
    async def kill(replica: ReplicaProcess, load: Load) -> str:
        await asyncio.to_thread(kill_replica, replica)
        return ""

    result = await _replica_fault(stack, replica_logs, "replica SIGKILL", 8, kill)
    assert_clean(result)
    assert result.statuses == {RunStatus.INTERRUPTED: 8}


@full_only
async def test_a_stopped_replica_has_its_runs_interrupted_within_five_seconds(stack: Stack, replica_logs):
    waited: list[float] = []

    async def stop(replica: ReplicaProcess, load: Load) -> str:
        os.killpg(replica.process.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            ended = await _wait_for(stack, load.run_ids, lambda status: status in TERMINAL_STATUSES, 30.0)
        finally:
            os.killpg(replica.process.pid, signal.SIGCONT)
        waited.append(ended - stopped)
        return f"INTERRUPTED {waited[0]:.1f} s after SIGSTOP (promise: <= 5 s)"

    result = await _replica_fault(stack, replica_logs, "replica SIGSTOP", 4, stop)
    assert_clean(result)
    assert result.statuses == {RunStatus.INTERRUPTED: 4}
    assert waited[0] <= 5.0, result.note


async def _wait_for(stack: Stack, run_ids: list[str], wanted: Callable[[str], bool],
                    timeout_s: float) -> float:
    """When (time.monotonic()) every run's status satisfies `wanted`; raises after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    ids = [uuid.UUID(run_id) for run_id in run_ids]
    while time.monotonic() < deadline:
        async with stack.sessionmaker() as session:
            statuses = (await session.scalars(select(Run.status).where(Run.id.in_(ids)))).all()
        if len(statuses) == len(ids) and all(wanted(status) for status in statuses):
            return time.monotonic()
        await asyncio.sleep(0.1)
    raise AssertionError(f"runs not all as wanted after {timeout_s} s")


@full_only
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
async def test_a_routing_worker_lost_under_load_has_its_runs_reaped_and_fenced(stack: Stack, fault: str):
    victim = stack.start_worker_process("chaos-victim")
    started = time.monotonic()
    load = Load(stack)
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        await load.submit(sdk, 6, 300, PROMPT)
        await _wait_for(stack, load.run_ids, lambda status: status == RunStatus.RUNNING, 20.0)
        stack.start_worker_process("chaos-survivor")
        os.kill(victim.process.pid, getattr(signal, fault))
        lapsed: list[str] = []
        await during(TEST_LEASE_SECONDS + 4.0, lambda: lease_violations(stack.sessionmaker), lapsed)
        if fault == "SIGSTOP":
            os.kill(victim.process.pid, signal.SIGCONT)   # the zombie wakes: its late writes must be refused
            await asyncio.sleep(2.0)
        result = await conclude(ChaosResult(f"routing worker {fault}"), load, started)
    result.violations.extend(lapsed)
    assert_clean(result)
    assert set(result.statuses) <= {RunStatus.INTERRUPTED, RunStatus.COMPLETED}
