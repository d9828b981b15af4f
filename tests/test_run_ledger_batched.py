"""The routing worker's run ledger shares its statements among runs (services/routing/run_ledger.py,
ledger/batching.py), on the real PostgreSQL: RUNNING marks and settlements that arrive while one of
their kind is being written go together in the next statement, each run answered under its own
epoch; terminal-published marks wait for others (a run that never went RUNNING is marked at once:
its Streams wait for that mark's NOTIFY)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest
from sluice.ledger.channels import EVENTS_CHANNEL
from sluice.ledger.models import Model, Run, RunStatus
from sluice.ledger.pg import HotPool, asyncpg_dsn
from sluice.ledger.runs_sql import (
    PublishedMark,
    RunningMark,
    mark_published_many,
    mark_running_many,
    record_starts,
)
from sluice.services.finish import Ending
from sluice.services.routing.claims import mark_queued
from sluice.services.routing.leases import Lease
from sluice.services.routing.run_ledger import LeaseLost, SqlRunLedger
from sqlalchemy import select

from sluice.eventlog.interface import LogPosition
from sluice.v1 import runs_pb2
from tests.support.ledger_factories import DEFAULT_MODEL, add_model, add_tenant, prompt_of
from tests.support.ledger_services import Services

pytestmark = pytest.mark.integration
pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]

LEASE_S = 5.0
LINGER_S = 0.1 * LEASE_S          # run_ledger.PUBLISHED_LINGER_LEASES of the lease


class CountingPool(HotPool):
    """A HotPool that counts checkouts: one checkout is one statement of the run ledger's."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.checkouts = 0

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        self.checkouts += 1
        async with super().connection() as connection:
            yield connection


class AppendOnlyLog:
    """The event log's append, numbering positions on partition 0."""

    def __init__(self) -> None:
        self.appended: list[runs_pb2.RunEvent] = []

    async def append(self, event: runs_pb2.RunEvent) -> LogPosition:
        self.appended.append(event)
        return LogPosition(0, 100 + len(self.appended))


async def leased(api: Services, count: int) -> list[Lease]:
    """`count` runs queued under their first epoch, as a routing worker claims them."""
    async with api.sessionmaker() as session, session.begin():
        if await session.get(Model, DEFAULT_MODEL.version) is None:
            await add_model(session, api.tokenizer)
        tenant = await add_tenant(session, f"t{uuid.uuid4().hex[:6]}")
    leases = []
    for _ in range(count):
        run_id = uuid.UUID((await api.submit(tenant, prompt_of(7), 8)).run_id)
        async with api.sessionmaker() as session, session.begin():
            _, epoch = await mark_queued(session, run_id, "r0", "w1", LEASE_S)
        leases.append(Lease(str(run_id), epoch, time.monotonic() + LEASE_S))
    return leases


async def rows(api: Services, leases: list[Lease]) -> list[tuple[str, bool]]:
    async with api.sessionmaker() as session:
        found = dict((str(row.id), (row.status, row.terminal_published)) for row in await session.execute(
            select(Run.id, Run.status, Run.terminal_published)
            .where(Run.id.in_([uuid.UUID(lease.run_id) for lease in leases]))))
    return [found[lease.run_id] for lease in leases]


@pytest.fixture
async def ledger(api: Services, database_dsn: str) -> AsyncIterator[SqlRunLedger]:
    pool = CountingPool(database_dsn)
    ledger = SqlRunLedger(api.sessionmaker, AppendOnlyLog(), "w1", LEASE_S, pool)  # type: ignore[arg-type]
    try:
        yield ledger
    finally:
        await ledger.close()
        await pool.close()


async def test_runs_that_reach_running_together_share_one_statement_each_under_its_own_epoch(
        api: Services, ledger: SqlRunLedger):
    leases = await leased(api, 4)
    stale = leases[3]
    stale.epoch += 1                    # a lease this run no longer has
    pool = ledger.pool
    assert isinstance(pool, CountingPool)
    before = pool.checkouts
    marked = await asyncio.gather(*(ledger.mark_running(lease, LogPosition(0, i), 1)
                                    for i, lease in enumerate(leases)), return_exceptions=True)
    # The first went alone, at once; the three that arrived while it was written went together.
    assert pool.checkouts - before == 2
    assert marked[:3] == [None, None, None] and isinstance(marked[3], LeaseLost)
    assert await rows(api, leases) == [("RUNNING", False)] * 3 + [("QUEUED", False)]


async def test_runs_that_end_together_settle_in_one_statement_and_their_published_marks_wait(
        api: Services, ledger: SqlRunLedger):
    leases = await leased(api, 3)
    for lease in leases[:2]:
        await ledger.mark_running(lease, LogPosition(0, 1), 1)
    pool = ledger.pool
    assert isinstance(pool, CountingPool)
    before = pool.checkouts
    endings = [Ending(RunStatus.COMPLETED, 3, 2), Ending(RunStatus.COMPLETED, 4, 3),
               Ending(RunStatus.FAILED, 0, 0, "refused", prompt_taken=False)]     # never went RUNNING
    records = await asyncio.gather(*(ledger.finish(lease, ending)
                                     for lease, ending in zip(leases, endings, strict=True)))
    assert pool.checkouts - before == 2
    assert [(record.sequence, record.status, record.usage.output_tokens) for record in records if record] == [
        (4, RunStatus.COMPLETED, 2), (5, RunStatus.COMPLETED, 3), (1, RunStatus.FAILED, 0)]
    before = pool.checkouts
    for record in records:
        assert record is not None
        await ledger.publish_terminal(record)
    # Only the run that never went RUNNING is marked by now (its Streams wait for that NOTIFY).
    assert await rows(api, leases) == [("COMPLETED", False), ("COMPLETED", False), ("FAILED", True)]
    assert pool.checkouts - before == 1
    await asyncio.sleep(LINGER_S + 0.3)
    assert await rows(api, leases) == [("COMPLETED", True), ("COMPLETED", True), ("FAILED", True)]
    assert pool.checkouts - before == 2          # both lingering marks in one statement


# The batched writes of runs, each given its runs highest id first (a batch is in arrival order).
BATCHED_WRITES: dict[str, Callable[[asyncpg.Connection, list[Lease]], Awaitable[object]]] = {
    "RUNNING marks": lambda connection, leases: mark_running_many(
        connection, [RunningMark(lease.run_id, lease.epoch, LogPosition(0, 1), 1) for lease in leases],
        EVENTS_CHANNEL),
    "start records": lambda connection, leases: record_starts(
        connection, [RunningMark(lease.run_id, lease.epoch, LogPosition(0, 1), 1) for lease in leases]),
    "published marks": lambda connection, leases: mark_published_many(
        connection, [PublishedMark(lease.run_id, 3, LogPosition(0, 3)) for lease in leases], EVENTS_CHANNEL),
}


@pytest.mark.parametrize("write", list(BATCHED_WRITES))
async def test_a_batched_write_locks_its_runs_in_id_order_whatever_the_order_of_its_batch(
        api: Services, database_dsn: str, write: str):
    """Two writers that lock shared rows in different orders can each hold one the other waits for:
    a batched start record and a batched settlement (which locks in id order) deadlocked so, and the
    settlement's run was given up INTERRUPTED. Here the lower run is held elsewhere while the write
    runs: in id order it waits there having locked nothing, so the higher run is still free."""
    leases = sorted(await leased(api, 2), key=lambda lease: uuid.UUID(lease.run_id))
    low, high = (uuid.UUID(lease.run_id) for lease in leases)
    dsn = asyncpg_dsn(database_dsn)
    holder, writer, prober = [await asyncpg.connect(dsn) for _ in range(3)]
    try:
        holding = holder.transaction()
        await holding.start()
        await holder.execute("SELECT id FROM runs WHERE id = $1 FOR UPDATE", low)
        writing = asyncio.create_task(BATCHED_WRITES[write](writer, leases[::-1]))
        await wait_for_lock_wait(prober, writer.get_server_pid())
        probing = prober.transaction()
        await probing.start()
        try:
            higher_free = await prober.fetchval(
                "SELECT id FROM runs WHERE id = $1 FOR UPDATE NOWAIT", high) == high
        except asyncpg.exceptions.LockNotAvailableError:
            higher_free = False
        await probing.rollback()
        await holding.rollback()
        await asyncio.wait_for(writing, 10)
    finally:
        for connection in (holder, writer, prober):
            await connection.close()
    assert higher_free


async def wait_for_lock_wait(connection: asyncpg.Connection, pid: int, timeout_s: float = 10.0) -> None:
    """Until the backend `pid` waits for a lock."""
    deadline = time.monotonic() + timeout_s
    waiting = "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1"
    while await connection.fetchval(waiting, pid) != "Lock":
        assert time.monotonic() < deadline, f"backend {pid} never waited for a lock"
        await asyncio.sleep(0.02)
