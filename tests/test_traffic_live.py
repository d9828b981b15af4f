"""Priority classes and the GPU-memory budget on the real run path (issue 14 points 4-5): real
PostgreSQL, Kafka, one routing worker and one Triton replica running the engine core (timing
executor: Llama-3-8B bf16 on one H100, in real time, a decode step >= 6.9 ms) with 8 batch slots.

The batch test raises [traffic].batch_max_slot_utilization to 0.75 so that batch can saturate the
replica's share: a batch run is dispatched only while (running + waiting) / 8 < 0.75, i.e. with at
most 5 in the replica, so 6 of the 8 slots is its most, and at most one batch run is sent per scrape
(queue depth below 1 per replica).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sluice.ledger.models import Run, RunStatus, Tenant
from sluice.services.errors import DETAIL_EXPIRED_WAITING_KV_BUDGET
from sluice_client.sdk import SluiceClient
from sqlalchemy import func, select, update

from sluice.v1 import common_pb2
from tests.support.replica_proc import ReplicaProcess, start_replica, stop_replica
from tests.support.routing_stack import Stack

pytestmark = pytest.mark.integration

SLOTS = 8
BATCH_SLOTS_USED = 6          # the largest n with (n - 1) / 8 < 0.75
BATCH_CAP = 1200              # >= 1200 x 6.9 ms = 8.3 s per batch run
MIN_BATCH_RUN_S = BATCH_CAP * 0.0069
PROMPT = "Summarise the history of sluice gates."


@pytest.fixture(scope="module")
def replicas(replica_logs: Path) -> Iterator[list[ReplicaProcess]]:
    replica = start_replica("core0", replica_logs, {"engine": "core", "max_num_seqs": SLOTS})
    try:
        yield [replica]
    finally:
        stop_replica(replica)


async def allow(stack: Stack, **values: object) -> None:
    async with stack.sessionmaker() as session, session.begin():
        await session.execute(update(Tenant).where(Tenant.id == stack.tenant.id).values(**values))


async def count(stack: Stack, priority: str, status: RunStatus) -> int:
    async with stack.sessionmaker() as session:
        return int(await session.scalar(select(func.count()).select_from(Run).where(
            Run.priority == priority, Run.status == status.value)) or 0)


async def wait_until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def runs(stack: Stack, ids: list[str]) -> list[Run]:
    return [await stack.run_row(run_id) for run_id in ids]


async def test_batch_saturating_the_pool_never_delays_an_interactive_runs_first_token(stack: Stack):
    await allow(stack, batch_allowed=True)
    stack.config = stack.config.updated(traffic={"batch_max_slot_utilization": 0.75})
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        batch = [(await sdk.submit(PROMPT, max_output_tokens=BATCH_CAP, batch=True)).run_id
                 for _ in range(20)]
        await stack.start_worker()
        await wait_until(lambda: _at_least(stack, BATCH_SLOTS_USED), 20.0, "batch to fill its share of slots")
        await asyncio.sleep(1.0)      # four more scrapes: batch stays at its share, the rest waits ACCEPTED
        assert await count(stack, "batch", RunStatus.RUNNING) == BATCH_SLOTS_USED
        assert await count(stack, "batch", RunStatus.ACCEPTED) == 20 - BATCH_SLOTS_USED

        interactive = await sdk.submit(PROMPT, max_output_tokens=16)
        done = await stack.wait_for_status(interactive.run_id, {RunStatus.COMPLETED.value}, timeout_s=20.0)
        batch_rows = await runs(stack, batch)
        for run_id in batch:
            await sdk.cancel(run_id)

    assert done.started_at is not None and done.queued_at is not None
    ttft_s = (done.started_at - done.created_at).total_seconds()
    # Its first token came before any batch run ended: it never waited for a batch slot to free ...
    finished_before = [r for r in batch_rows
                       if r.finished_at is not None and r.finished_at <= done.started_at]
    assert finished_before == []
    assert ttft_s < MIN_BATCH_RUN_S
    # ... and no batch run was claimed while it waited: the pool had no batch headroom left.
    claimed_meanwhile = [r for r in batch_rows if r.queued_at is not None
                         and done.created_at <= r.queued_at <= done.queued_at]
    assert claimed_meanwhile == []


async def _at_least(stack: Stack, running: int) -> bool:
    return await count(stack, "batch", RunStatus.RUNNING) >= running


async def test_a_tenant_at_its_gpu_memory_cap_waits_and_then_runs(stack: Stack):
    cap = 400                      # >= 400 x 6.9 ms = 2.8 s per run
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        submitted = [await sdk.submit(PROMPT, max_output_tokens=cap) for _ in range(3)]
        held_each = submitted[0].input_tokens + cap
        budget = 2 * held_each     # two runs at once; the third must wait for one to end
        await allow(stack, kv_token_budget=budget)
        await stack.start_worker()
        first, second, third = (s.run_id for s in submitted)

        await stack.wait_for_status(second, {RunStatus.RUNNING.value}, timeout_s=10.0)
        waiting = await stack.run_row(third)
        usage = await sdk.usage()
        assert waiting.status == RunStatus.ACCEPTED.value
        assert (usage.kv_token_budget, usage.kv_tokens_held) == (budget, budget)

        for run_id in (first, second, third):
            await stack.wait_for_status(run_id, {RunStatus.COMPLETED.value}, timeout_s=20.0)
        one, two, three = await runs(stack, [first, second, third])

    assert one.queued_at is not None and two.queued_at is not None and three.queued_at is not None
    assert one.finished_at is not None and two.finished_at is not None
    assert three.queued_at >= min(one.finished_at, two.finished_at)   # claimed only once one had ended
    assert max(one.queued_at, two.queued_at) < min(one.finished_at, two.finished_at)


async def test_a_run_whose_deadline_passes_while_its_tenant_is_at_its_cap_expires_saying_so(stack: Stack):
    cap = 400
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        holders = [await sdk.submit(PROMPT, max_output_tokens=cap) for _ in range(2)]
        budget = 2 * (holders[0].input_tokens + cap)
        await allow(stack, kv_token_budget=budget)
        await stack.start_worker()
        await stack.wait_for_status(holders[1].run_id, {RunStatus.RUNNING.value}, timeout_s=10.0)
        late = await sdk.submit(PROMPT, max_output_tokens=16, deadline_ms=1000)
        expired = await stack.wait_for_status(late.run_id, {RunStatus.EXPIRED.value}, timeout_s=10.0)
        shown = await sdk.get_run(late.run_id)

    needed = late.input_tokens + 16
    assert expired.detail == DETAIL_EXPIRED_WAITING_KV_BUDGET.format(held=budget, budget=budget,
                                                                     needed=needed)
    assert shown.status == common_pb2.RUN_STATUS_EXPIRED and shown.detail == expired.detail
    assert expired.queued_at is None and expired.output_tokens == 0

