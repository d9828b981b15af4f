"""The ledger writes of one run's driver, behind a Protocol so the driver can be tested in memory.

Each write is one short transaction conditioned on the driver's lease epoch (claims.py). A
transient database error (connection lost, PostgreSQL restarting, a failover) is retried until
the lease runs out: a blip shorter than the lease interrupts nothing. Every write is idempotent
under its epoch, so a retry after a commit whose acknowledgment was lost changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import asyncpg
from sluice.ledger.channels import EVENTS_CHANNEL
from sluice.ledger.pg import HotPool
from sluice.ledger.runs_sql import mark_running
from sluice.ledger.settlement import NotOwned
from sluice.ledger.transient import transient
from sluice.services.finish import (
    Ending,
    TerminalRecord,
    record_published,
    settle_and_fix_terminal,
    terminal_event_of,
)
from sluice.services.routing.claims import reassign_replica
from sluice.services.routing.leases import Lease
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.eventlog.interface import EventLog, LogPosition

log = logging.getLogger(__name__)

RETRY_S = 0.1
T = TypeVar("T")


class LeaseLost(Exception):
    """The run is no longer this driver's (renewal refused, lease expired, epoch moved on):
    it must not write anything more."""


class RunLedger(Protocol):
    async def mark_running(self, lease: Lease, first: LogPosition, last_sequence: int) -> None:
        """QUEUED → RUNNING with where the run's events start. Raises LeaseLost."""
        ...

    async def reassign(self, lease: Lease, replica: str) -> None:
        """A retry's new replica, recorded before it is contacted. Raises LeaseLost."""
        ...

    async def finish(self, lease: Lease, ending: Ending) -> TerminalRecord | None:
        """Settle the run and fix its terminal event; None if it was already settled.
        Raises LeaseLost."""
        ...

    async def publish_terminal(self, record: TerminalRecord) -> None:
        """Publish the terminal event and record that it was published."""
        ...


@dataclass(frozen=True, slots=True)
class SqlRunLedger:
    sessions: async_sessionmaker[AsyncSession]
    events: EventLog
    owner: str
    lease_seconds: float
    pool: HotPool                # the process's hot connections for the run path (ledger/pg.py)

    async def _retrying(self, lease: Lease, write: Callable[[], Awaitable[T]]) -> T:
        return await _retried(lease.run_id, write, lambda: lease.valid(time.monotonic()))

    async def _in_transaction(self, lease: Lease, write: Callable[[AsyncSession], Awaitable[T]]) -> T:
        async def attempt() -> T:
            async with self.sessions() as session, session.begin():
                return await write(session)
        return await self._retrying(lease, attempt)

    async def _autocommit(self, lease: Lease, write: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        """A single-statement write on a hot connection: one round trip, no BEGIN/COMMIT."""
        async def attempt() -> T:
            async with self.pool.connection() as connection:
                return await write(connection)
        return await self._retrying(lease, attempt)

    async def mark_running(self, lease: Lease, first: LogPosition, last_sequence: int) -> None:
        async def write(connection: asyncpg.Connection) -> bool:
            return await mark_running(connection, lease.run_id, lease.epoch, first, last_sequence,
                                      EVENTS_CHANNEL)
        if not await self._autocommit(lease, write):
            raise LeaseLost("the ledger refused RUNNING under this epoch")

    async def reassign(self, lease: Lease, replica: str) -> None:
        async def write(session: AsyncSession) -> bool:
            return await reassign_replica(session, lease.run_id, lease.epoch, replica)
        if not await self._in_transaction(lease, write):
            raise LeaseLost("the ledger refused the new replica under this epoch")

    async def finish(self, lease: Lease, ending: Ending) -> TerminalRecord | None:
        async def attempt() -> TerminalRecord | None:
            # One statement on a hot connection, its own transaction (no BEGIN/COMMIT round trips):
            # the run read row-locked under this epoch and settled (ledger/settlement.py, _OWNED).
            async with self.pool.connection() as connection:
                return await settle_and_fix_terminal(connection, lease.run_id, ending, self.owner,
                                                     self.lease_seconds, lease.epoch, owned=True)
        try:
            return await self._retrying(lease, attempt)
        except NotOwned as gone:
            raise LeaseLost("the run is no longer active under this epoch") from gone

    async def publish_terminal(self, record: TerminalRecord) -> None:
        # Settling gave the run a fresh lease for its publisher: recording the publication is retried
        # within it, so a blip does not leave a reaper to republish (a harmless copy, but late).
        until = time.monotonic() + self.lease_seconds
        position = await self.events.append(terminal_event_of(record))
        await _retried(record.run_id, lambda: record_published(self.sessions, record, position, self.pool),
                       lambda: time.monotonic() < until)


async def _retried(run_id: str, write: Callable[[], Awaitable[T]], may_retry: Callable[[], bool]) -> T:
    """`write()`, again after each transient database error while `may_retry()`."""
    while True:
        try:
            return await write()
        except Exception as error:
            if not transient(error) or not may_retry():
                raise
            log.warning("run %s: ledger write failed (%r); retrying within the lease", run_id, error)
            await asyncio.sleep(RETRY_S)
