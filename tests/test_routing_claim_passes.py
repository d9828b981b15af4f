"""Claim passes in flight at once (services/routing/worker.py, MAX_CLAIM_PASSES), on the real stack: a
run whose NOTIFY arrives after the claim pass in flight sent its lock is claimed by a second pass at
once, not after the first one's COMMIT; SKIP LOCKED keeps the two passes apart."""

from __future__ import annotations

import asyncio

import pytest
from sluice.ledger.claims_sql import queue_runs
from sluice.ledger.models import RunStatus
from sluice.services.routing import worker as routing_worker
from sluice_client.sdk import SluiceClient

from tests.support.routing_stack import Stack

pytestmark = pytest.mark.integration

PROMPT = "Tell me about sluice gates."
CLAIMED = {RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.COMPLETED}
SLOW_POLL_MS = 10_000       # only admission's NOTIFY can start a pass


async def test_a_run_notified_while_a_pass_holds_its_lock_is_claimed_by_a_second_pass_meanwhile(
        stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    stack.config = stack.config.updated(routing={"poll_interval_ms": SLOW_POLL_MS})
    held, release = asyncio.Event(), asyncio.Event()
    queued: list[set[str]] = []

    async def first_pass_held(connection, replicas, owner, lease_seconds):  # type: ignore[no-untyped-def]
        # The first pass to route anything stops here, its runs locked, until the test releases it.
        first = not queued
        queued.append({str(run_id) for run_id in replicas})
        if first:
            held.set()
            await release.wait()
        return await queue_runs(connection, replicas, owner, lease_seconds)

    monkeypatch.setattr(routing_worker, "queue_runs", first_pass_held)
    await stack.start_worker()
    await asyncio.sleep(0.5)         # its first pass (nothing waits) done, its LISTEN up
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        early = await sdk.submit(PROMPT, max_output_tokens=4)
        await asyncio.wait_for(held.wait(), 10)
        late = await sdk.submit(PROMPT, max_output_tokens=4)
        try:
            claimed = await stack.wait_for_status(late.run_id, CLAIMED, timeout_s=10)
            assert (await stack.run_row(early.run_id)).status == RunStatus.ACCEPTED   # still held
        finally:
            release.set()
        assert claimed.replica is not None
        await stack.wait_for_status(early.run_id, CLAIMED, timeout_s=10)
    assert queued == [{early.run_id}, {late.run_id}]


async def test_a_full_pass_is_followed_by_the_next_at_once_not_at_the_poll_timer(
        stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    # Three runs wait before the worker starts (their NOTIFYs went to nobody) and a pass claims one:
    # each full pass must wake the claim loop for the next at once. On the poll timer alone, the
    # third run would wait two polls (20 s).
    stack.config = stack.config.updated(routing={"poll_interval_ms": SLOW_POLL_MS})
    monkeypatch.setattr(routing_worker, "CLAIM_BATCH", 1)
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        runs = [await sdk.submit(PROMPT, max_output_tokens=4) for _ in range(3)]
        await stack.start_worker()
        for run in runs:
            await stack.wait_for_status(run.run_id, CLAIMED, timeout_s=5)
