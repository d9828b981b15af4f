"""The claim's statements on real PostgreSQL (ledger/claims_sql.py), on raw asyncpg connections as
the routing worker runs them: two workers claiming at once take each ready run exactly once, a run
is queued once whoever asks, interactive runs come before batch, and batch only fills what is left."""

from __future__ import annotations

import asyncio
import uuid

from sluice.ledger.claims_sql import lock_accepted, queue_runs
from sluice.ledger.models import Model, Run
from sluice.ledger.pg import HotPool
from sqlalchemy import select, update

from tests.support.ledger_factories import DEFAULT_MODEL, TenantHandle, add_model, add_tenant, prompt_of
from tests.support.ledger_services import Services

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]

LEASE_S = 5.0
NOT_WAITING_S = 3.0     # a claim that waits this long on another's locks is blocked, not skipping



async def accepted_runs(api: Services, count: int) -> tuple[TenantHandle, list[uuid.UUID]]:
    """`count` ACCEPTED runs of one tenant, oldest first."""
    async with api.sessionmaker() as session, session.begin():
        if await session.get(Model, DEFAULT_MODEL.version) is None:
            await add_model(session, api.tokenizer)
        tenant = await add_tenant(session, f"t{uuid.uuid4().hex[:6]}")
    runs = [uuid.UUID((await api.submit(tenant, prompt_of(4), 8)).run_id) for _ in range(count)]
    return tenant, runs


async def make_batch(api: Services, runs: list[uuid.UUID]) -> None:
    async with api.sessionmaker() as session, session.begin():
        await session.execute(update(Run).where(Run.id.in_(runs)).values(priority="batch"))


async def claims(api: Services) -> dict[uuid.UUID, tuple[str, str | None, str | None, int]]:
    async with api.sessionmaker() as session:
        rows = await session.execute(select(Run.id, Run.status, Run.lease_owner, Run.replica,
                                            Run.lease_epoch))
    return {row.id: (row.status, row.lease_owner, row.replica, row.lease_epoch) for row in rows}


async def test_two_workers_claiming_at_once_take_each_ready_run_exactly_once(
        api: Services, hot_pool: HotPool):
    _, runs = await accepted_runs(api, 10)
    async with hot_pool.connection() as first, hot_pool.connection() as second:
        async with first.transaction():
            taken_first = [row["id"] for row in await lock_accepted(first, 6)]
            # The first claim still holds its rows: the second skips them instead of waiting.
            async with second.transaction():
                taken_second = [row["id"] for row in
                                await asyncio.wait_for(lock_accepted(second, 6), NOT_WAITING_S)]
                queued_second = await queue_runs(second, dict.fromkeys(taken_second, "r1"), "w2", LEASE_S)
            queued_first = await queue_runs(first, dict.fromkeys(taken_first, "r0"), "w1", LEASE_S)
        async with first.transaction():
            again = await lock_accepted(first, 6)
    assert taken_first == runs[:6] and taken_second == runs[6:]      # oldest first, disjoint
    assert set(queued_first) == set(runs[:6]) and set(queued_second) == set(runs[6:])
    assert {epoch for _, epoch in [*queued_first.values(), *queued_second.values()]} == {1}
    assert again == []
    ledger = await claims(api)
    assert [ledger[run] for run in runs] == [("QUEUED", "w1", "r0", 1)] * 6 + [("QUEUED", "w2", "r1", 1)] * 4


async def test_a_run_is_queued_once_whoever_asks(api: Services, hot_pool: HotPool):
    _, runs = await accepted_runs(api, 2)
    async with hot_pool.connection() as connection:
        first = await queue_runs(connection, {runs[0]: "r0"}, "w1", LEASE_S)
        # A second claimer that read the run as ACCEPTED before the first committed gets nothing.
        second = await queue_runs(connection, {runs[0]: "r1", runs[1]: "r1"}, "w2", LEASE_S)
    assert set(first) == {runs[0]} and set(second) == {runs[1]}
    ledger = await claims(api)
    assert (ledger[runs[0]], ledger[runs[1]]) == (("QUEUED", "w1", "r0", 1), ("QUEUED", "w2", "r1", 1))


async def test_interactive_runs_come_first_and_batch_only_fills_what_is_left(
        api: Services, hot_pool: HotPool):
    _, runs = await accepted_runs(api, 6)
    batch, interactive = runs[:3], runs[3:]          # the batch runs are the older ones
    await make_batch(api, batch)
    pool_name = DEFAULT_MODEL.version

    async def locked(limit: int, excluding: tuple[str, ...] = ()) -> list[uuid.UUID]:
        async with hot_pool.connection() as connection, connection.transaction():
            return [row["id"] for row in await lock_accepted(connection, limit, excluding)]

    async with api.sessionmaker() as session:
        model_pool = await session.scalar(select(Model.worker_pool).where(Model.version == pool_name))
    assert await locked(4) == [*interactive, batch[0]]
    assert await locked(2) == interactive[:2]
    assert await locked(6, excluding=(str(model_pool),)) == interactive
    assert await locked(6, excluding=("another-pool",)) == [*interactive, *batch]
