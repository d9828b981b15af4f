"""A routing worker wakes on admission's NOTIFY of a new run instead of waiting for its next poll,
and a burst of notifications costs one claim pass, not one per notification (real PostgreSQL,
Kafka and Triton replicas)."""

from __future__ import annotations

import asyncio

import pytest
from sluice.ledger.channels import RUNS_ACCEPTED_CHANNEL
from sluice.ledger.models import RunStatus
from sluice.services.routing.worker import IDLE_POLL_S, RoutingWorker
from sluice_client.sdk import SluiceClient
from sqlalchemy import text

from tests.support.routing_stack import MODEL, Stack

pytestmark = pytest.mark.integration

PROMPT = "Tell me about sluice gates."
SLOW_POLL_MS = 10_000       # so slow that only a notification can explain a prompt claim
SETTLE_S = 0.5              # the worker's first poll done and its LISTEN connection open


async def counting_worker(stack: Stack) -> tuple[RoutingWorker, list[int]]:
    """A worker at the configured poll interval, counting its claim passes."""
    worker = await stack.start_worker()   # its serve() task has not run yet: the wrapper is in time
    passes: list[int] = []
    claim_once = worker.claim_once

    async def counted() -> bool:
        passes.append(1)
        return await claim_once()

    worker.claim_once = counted  # type: ignore[method-assign]
    return worker, passes


async def slow_polling_worker(stack: Stack) -> tuple[RoutingWorker, list[int]]:
    """A worker polling every 10 s, and a list that grows by one with each claim pass it makes."""
    stack.config = stack.config.updated(routing={"poll_interval_ms": SLOW_POLL_MS})
    worker, passes = await counting_worker(stack)
    await asyncio.sleep(SETTLE_S)
    return worker, passes


async def notify_times(stack: Stack, pool: str, times: int) -> None:
    async with stack.sessionmaker() as session, session.begin():
        for _ in range(times):
            await session.execute(text("SELECT pg_notify(:channel, :pool)"),
                                  {"channel": RUNS_ACCEPTED_CHANNEL, "pool": pool})


async def test_a_worker_polling_every_10_s_claims_a_new_run_within_a_second_of_its_submit(stack: Stack):
    await slow_polling_worker(stack)
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=4)
    claimed = await stack.wait_for_status(
        run.run_id, {RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.COMPLETED}, timeout_s=1.0)
    assert claimed.replica is not None


async def test_fifty_notifications_in_one_commit_wake_the_claim_loop_once(stack: Stack):
    _, passes = await slow_polling_worker(stack)
    before = len(passes)
    await notify_times(stack, MODEL.version, 50)
    await asyncio.sleep(SETTLE_S)
    # One pass per wake-up, not per notification (two at most, should the burst straddle a pass).
    assert 1 <= len(passes) - before <= 2


async def test_a_notification_for_a_pool_the_worker_does_not_serve_wakes_nothing(stack: Stack):
    _, passes = await slow_polling_worker(stack)
    before = len(passes)
    await notify_times(stack, "some-other-pool", 5)
    await asyncio.sleep(SETTLE_S)
    assert len(passes) == before



async def test_an_idle_worker_that_hears_admission_polls_once_a_second_and_still_claims_at_once(stack: Stack):
    worker, passes = await counting_worker(stack)
    poll_s = stack.config.routing.poll_interval_ms / 1000
    await asyncio.sleep(SETTLE_S)
    assert worker._accepted_listener is not None and worker._accepted_listener.listening
    before = len(passes)
    await asyncio.sleep(IDLE_POLL_S * 1.5)
    # Nothing waits: one or two polls in 1.5 s (its timer still polls), where the poll interval alone
    # would make 1.5 / poll_s.
    assert 1 <= len(passes) - before <= 2 < 1.5 / poll_s
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        run = await sdk.submit(PROMPT, max_output_tokens=4)
    claimed = await stack.wait_for_status(
        run.run_id, {RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.COMPLETED}, timeout_s=IDLE_POLL_S / 2)
    assert claimed.replica is not None
