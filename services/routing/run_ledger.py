"""The ledger writes of one run's driver, behind a Protocol so the driver can be tested in memory.

Each write is one short transaction conditioned on the driver's lease epoch (claims.py). A
transient database error (connection lost, PostgreSQL restarting, a failover) or a transaction
rolled back for losing a race (a deadlock) is retried until the lease runs out: a blip shorter than
the lease interrupts nothing. Every write is idempotent under its epoch, so a retry after a commit
whose acknowledgment was lost changes nothing. The batched writes lock their runs in id order, as
the settlement does, so that two of them never wait on each other in a cycle (ledger/runs_sql.py).

The process's drivers share their writes of one kind (ledger/batching.py): RUNNING marks, the
starts recorded after them, and settlements that arrive while one of their kind is being written go
together in the next statement (a lone run's is sent at once; RUNNING marks never wait behind a
statement of another kind); terminal-published marks, which nobody waits for, are
gathered for up to PUBLISHED_LINGER_S and written in one statement for every run published
meanwhile. A run's TERMINAL event is durable
before its mark is written; should the process die in between, the reaper republishes the same
event once the publisher's lease lapses (services/finish.py), as after any crash between the two.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from sluice.ledger.batching import WriteBatcher
from sluice.ledger.channels import EVENTS_CHANNEL
from sluice.ledger.pg import HotPool
from sluice.ledger.runs_sql import (
    PublishedMark,
    RunningMark,
    mark_published_many,
    mark_running_many,
    record_starts,
)
from sluice.ledger.settlement import OwnedSettled, OwnedSettlement, settle_owned_many
from sluice.ledger.transient import retryable
from sluice.services.finish import (
    Ending,
    TerminalRecord,
    owned_settlement,
    record_published,
    settled_record,
    terminal_event_of,
)
from sluice.services.routing.claims import reassign_replica
from sluice.services.routing.leases import Lease
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.eventlog.interface import EventLog, LogPosition

log = logging.getLogger(__name__)

RETRY_S = 0.1
# How long a terminal-published mark waits for others to share its statement: a small share of the
# publisher's lease (the reaper republishes only once that lapses). At 35 runs/s, ~17 marks share one
# statement: ~60 us a run instead of ~280 (a row more costs ~50 us, a statement ~200 us).
PUBLISHED_LINGER_S = 0.5
PUBLISHED_LINGER_LEASES = 0.1
T = TypeVar("T")


class LeaseLost(Exception):
    """The run is no longer this driver's (renewal refused, lease expired, epoch moved on):
    it must not write anything more."""


class RunLedger(Protocol):
    async def mark_running(self, lease: Lease, first: LogPosition | None, last_sequence: int) -> None:
        """QUEUED → RUNNING, with where the run's events start when known (None: record_start follows).
        Raises LeaseLost."""
        ...

    def record_start(self, lease: Lease, first: LogPosition, last_sequence: int) -> None:
        """Where the run's events start, once durable, after a mark_running without it. Not waited
        for: written soon after (retried within the lease); a run whose start is never recorded is
        still settled with it (Ending.first) or, if its driver dies, located by the reaper."""
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
class _Unpublished:
    mark: PublishedMark
    until: float                 # monotonic: the publisher's lease ends (the mark is retried until then)


@dataclass(slots=True)
class SqlRunLedger:
    sessions: async_sessionmaker[AsyncSession]
    events: EventLog
    owner: str
    lease_seconds: float
    pool: HotPool                # the process's hot connections for the run path (ledger/pg.py)
    _running: WriteBatcher[RunningMark, bool] = field(init=False)
    _starts: WriteBatcher[RunningMark, bool] = field(init=False)
    _recording: set[asyncio.Task[bool]] = field(default_factory=set)    # record_start's, until written
    _settling: WriteBatcher[OwnedSettlement, OwnedSettled] = field(init=False)
    _published: WriteBatcher[_Unpublished, None] = field(init=False)

    def __post_init__(self) -> None:
        self._running = WriteBatcher(self._mark_running)
        self._starts = WriteBatcher(self._record_starts)
        self._settling = WriteBatcher(self._settle)
        linger_s = min(PUBLISHED_LINGER_S, PUBLISHED_LINGER_LEASES * self.lease_seconds)
        self._published = WriteBatcher(self._mark_published, linger_s=linger_s)

    async def close(self) -> None:
        """Write every mark still waiting (before the pool closes)."""
        await self._running.flush()
        if self._recording:
            await asyncio.wait(set(self._recording))
        await self._starts.flush()
        await self._settling.flush()
        await self._published.flush()

    async def _retrying(self, lease: Lease, write: Callable[[], Awaitable[T]]) -> T:
        return await _retried(lease.run_id, write, lambda: lease.valid(time.monotonic()))

    async def _in_transaction(self, lease: Lease, write: Callable[[AsyncSession], Awaitable[T]]) -> T:
        async def attempt() -> T:
            async with self.sessions() as session, session.begin():
                return await write(session)
        return await self._retrying(lease, attempt)

    async def mark_running(self, lease: Lease, first: LogPosition | None, last_sequence: int) -> None:
        mark = RunningMark(lease.run_id, lease.epoch, first, last_sequence)
        # A transient error fails the whole statement: each driver submits again (to the next one).
        if not await self._retrying(lease, lambda: self._running.submit(mark)):
            raise LeaseLost("the ledger refused RUNNING under this epoch")

    async def _mark_running(self, marks: list[RunningMark]) -> list[bool]:
        async with self.pool.connection() as connection:
            return await mark_running_many(connection, marks, EVENTS_CHANNEL)

    def record_start(self, lease: Lease, first: LogPosition, last_sequence: int) -> None:
        mark = RunningMark(lease.run_id, lease.epoch, first, last_sequence)
        task = asyncio.ensure_future(self._retrying(lease, lambda: self._starts.submit(mark)))
        self._recording.add(task)
        task.add_done_callback(self._recording.discard)
        task.add_done_callback(_start_recorded)

    async def _record_starts(self, marks: list[RunningMark]) -> list[bool]:
        async with self.pool.connection() as connection:
            return await record_starts(connection, marks)

    async def reassign(self, lease: Lease, replica: str) -> None:
        async def write(session: AsyncSession) -> bool:
            return await reassign_replica(session, lease.run_id, lease.epoch, replica)
        if not await self._in_transaction(lease, write):
            raise LeaseLost("the ledger refused the new replica under this epoch")

    async def finish(self, lease: Lease, ending: Ending) -> TerminalRecord | None:
        # One statement on a hot connection for every run ending meanwhile, its own transaction: each
        # run read row-locked under its epoch and settled (ledger/settlement.py, _OWNED_MANY).
        item = owned_settlement(lease.run_id, ending, self.owner, self.lease_seconds, lease.epoch)
        settled = await self._retrying(lease, lambda: self._settling.submit(item))
        if not settled.owned:
            raise LeaseLost("the run is no longer active under this epoch")
        if settled.impossible is not None:
            raise settled.impossible
        if settled.usage is None:
            return None
        return settled_record(lease.run_id, ending, settled.usage, lease.epoch)

    async def _settle(self, items: list[OwnedSettlement]) -> list[OwnedSettled]:
        async with self.pool.connection() as connection:
            return await settle_owned_many(connection, items)

    async def publish_terminal(self, record: TerminalRecord) -> None:
        # Settling gave the run a fresh lease for its publisher: recording the publication is retried
        # within it, so a blip does not leave a reaper to republish (a harmless copy, but late).
        until = time.monotonic() + self.lease_seconds
        position = await self.events.append(terminal_event_of(record))
        if record.sequence == 1:
            # The run's only event: it never went RUNNING, so its Streams wait for this mark's NOTIFY
            # to learn where its events start. Written at once.
            await _retried(record.run_id, lambda: record_published(self.sessions, record, position,
                                                                   self.pool),
                           lambda: time.monotonic() < until)
            return
        self._published.submit(_Unpublished(PublishedMark(record.run_id, record.sequence, position), until))

    async def _mark_published(self, marks: list[_Unpublished]) -> list[None]:
        """One statement for `marks`, retried while any of their publishers' leases lasts. Never raises:
        a mark not written leaves its run to the reaper, which republishes the same event."""
        pending = marks
        while True:
            try:
                async with self.pool.connection() as connection:
                    await mark_published_many(connection, [item.mark for item in pending], EVENTS_CHANNEL)
                return [None] * len(marks)
            except Exception as error:
                now = time.monotonic()
                pending = [item for item in pending if now < item.until]
                if not retryable(error) or not pending:
                    log.warning("%d terminal-published marks not written (%r): the reaper republishes"
                                " their terminal events", len(marks), error)
                    return [None] * len(marks)
                log.warning("terminal-published marks failed (%r); retrying within the lease", error)
                await asyncio.sleep(RETRY_S)


def _start_recorded(task: asyncio.Future[bool]) -> None:
    """A start not written is logged, not raised: the settlement carries it (Ending.first)."""
    if task.cancelled():
        return
    if (error := task.exception()) is not None:
        log.warning("a run's start could not be recorded (%r); its settlement records it", error)


async def _retried(run_id: str, write: Callable[[], Awaitable[T]], may_retry: Callable[[], bool]) -> T:
    """`write()`, again after each retryable database error (ledger/transient.py) while `may_retry()`."""
    while True:
        try:
            return await write()
        except Exception as error:
            if not retryable(error) or not may_retry():
                raise
            log.warning("run %s: ledger write failed (%r); retrying within the lease", run_id, error)
            await asyncio.sleep(RETRY_S)
