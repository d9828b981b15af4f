"""Leases: the ledger is the only clock that ends a driver's ownership of a run.

    claim (epoch e, expires T0) ──▶ driver works while  now < ends_by  and not refused
                                          ▲
    LeaseKeeper thread ── every lease/5 ──┘  one UPDATE renews every lease of the process;
      own event loop, own connections        each row returns how long its lease has left
      (never behind token work, never        (ledger clock); missing rows = refused
       behind the shared pool)

- A renewal returns, per run, the seconds left on its lease by the database's clock. The
  statement ran somewhere between when it left this process (`sent`) and when its answer
  came back (`answered`), so the ledger's deadline lies between `sent + remaining`
  (expires_at: renew before it) and `answered + remaining` (ends_by: past it the lease has
  truly expired by the ledger's clock, unless a renewal not yet answered moved it).
- A renewal is never cut short while it may still save the leases: a slow database (a busy
  box, a stall shorter than the lease) answers late but within the lease, and a renewal
  cancelled at a fixed timeout and sent again behind a reconnect would never land (seen:
  49 of 256 runs lost on a saturated box). Instead, an attempt unanswered after HEDGE_SHARE
  of the lease it has left is joined by another on a fresh connection (a dead connection,
  a backend that stopped), up to MAX_ATTEMPTS at once; the first answer wins and the others
  are dropped. An attempt that fails (connection lost, PostgreSQL restarting) is followed by
  another RETRY_S later, for as long as it takes: an outage shorter than the lease
  interrupts nothing.
- A driver stops only when a renewal is refused (a reaper took the run: its epoch moved on, or
  it ended) or the lease has truly expired (ends_by). A renewal that ran late, after the
  ledger's deadline but before any reaper took the run, still renews it (fencing by epoch
  keeps that safe): a busy database does not turn a renewal sent in time into a lost run.
- Fencing: the epoch a driver was granted conditions every ledger write it makes
  (claims.py) and is stamped on every event it publishes; a reaper taking the run
  over publishes a fence with the next epoch first, after which every reader drops
  the old owner's events (eventlog/events.py, "Fencing").
- The keeper renews only while the process's main event loop still beats: a loop
  wedged for WEDGED_LEASES leases lets its leases lapse, so a stuck process cannot
  hold runs forever (a merely busy one beats every few hundred milliseconds).

Lease-renewal lag (seconds a renewal completed after it was due) and failed attempts are
metrics: sluice_lease_renewal_lag_seconds, sluice_lease_renewal_failures_total.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from sluice.ledger.pg import KnownTypesConnection, asyncpg_dsn

log = logging.getLogger(__name__)

RETRY_S = 0.2                # after a failed renewal attempt, try again this soon
CONNECT_TIMEOUT_S = 1.0
HEDGE_SHARE = 1 / 2          # an attempt unanswered after this share of the lease left: another one
MIN_HEDGE_S = 0.1
MAX_ATTEMPTS = 3             # attempts of one renewal in flight at once (one connection each)
ATTEMPT_LEASES = 2.0         # an attempt (connecting included) given up after this many leases: a
                             #   connection that silent is dead (a late answer is still a verdict)
APPLICATION_NAME = "sluice-lease-keeper"    # how the keeper's backends show in pg_stat_activity
WEDGED_LEASES = 4.0          # main loop silent this many leases: stop renewing (see module doc)
HEARTBEAT_S = 0.25

# One statement for every lease of the process. Rows another transaction holds locked (a driver
# settling, Runs.Cancel, a reaper taking over) are skipped, not waited for: the renewal never queues
# behind other work. A skipped row still ours by the snapshot is neither renewed nor refused this
# round; only a row whose epoch moved on or that ended is refused. A renewal sent within the lease and
# run late (a busy database) still renews: the epoch, not the clock, says whether a reaper took it.
# The lease runs from when the row is written (clock_timestamp()), not from the transaction's start
# (now()): a transaction opened earlier than the statement (an implicit one left open by a prepare,
# ledger/pg.KnownTypesConnection) must not date a renewal back, not even by a second.
RENEW_SQL = """
    WITH p AS (
        SELECT * FROM unnest($2::uuid[], $3::bigint[], $4::bigint[], $5::int[])
                   AS p(id, epoch, last_sequence, output_tokens)
    ), ours AS (
        SELECT r.id FROM runs AS r JOIN p ON r.id = p.id AND r.lease_epoch = p.epoch
         WHERE r.status IN ('QUEUED', 'RUNNING')
    ), locked AS (
        SELECT r.id FROM runs AS r JOIN p ON r.id = p.id AND r.lease_epoch = p.epoch
         WHERE r.status IN ('QUEUED', 'RUNNING')
           FOR UPDATE OF r SKIP LOCKED
    ), renewed AS (
        UPDATE runs AS r
           SET lease_expires_at = clock_timestamp() + make_interval(secs => $1::float8),
               last_sequence = GREATEST(r.last_sequence, p.last_sequence),
               output_tokens = GREATEST(r.output_tokens, p.output_tokens)
          FROM p, locked
         WHERE r.id = locked.id AND p.id = locked.id
        RETURNING r.id, r.cancel_requested_at IS NOT NULL AS cancel_requested,
                  extract(epoch FROM r.lease_expires_at - clock_timestamp())::float8 AS remaining_s
    )
    SELECT p.id::text AS id, renewed.cancel_requested, renewed.remaining_s,
           ours.id IS NOT NULL AS ours
      FROM p LEFT JOIN ours ON ours.id = p.id LEFT JOIN renewed ON renewed.id = p.id
"""


@dataclass(slots=True, eq=False)
class Lease:
    """One run's lease as its driver sees it. Written by the keeper thread (expires_at, refused,
    cancel_requested) and by the driver (progress); each field is one atomic store."""

    run_id: str
    epoch: int                   # fencing token granted with the claim
    expires_at: float            # monotonic; the ledger's deadline, never later
    last_sequence: int = 0       # durable progress, recorded with every renewal
    output_tokens: int = 0
    refused: bool = False        # a renewal found the run under another epoch or ended
    cancel_requested: bool = False
    answered_by: float = 0.0     # monotonic; the ledger's deadline, never earlier (0: expires_at)

    @property
    def ends_by(self) -> float:
        """When the lease has truly expired by the ledger's clock, failing a renewal since."""
        return max(self.expires_at, self.answered_by)

    def valid(self, now: float) -> bool:
        return not self.refused and now < self.ends_by


@dataclass(frozen=True, slots=True)
class Renewed:
    run_id: str
    ours: bool                   # False: refused (the epoch moved on, or the run ended)
    cancel_requested: bool
    remaining_s: float | None    # seconds left on the renewed lease by the ledger's clock;
                                 #   None: skipped this round (row locked by another transaction)


def apply_renewal(leases: Sequence[Lease], renewed: Sequence[Renewed], sent_at: float,
                  answered_at: float | None = None) -> tuple[list[Lease], list[Lease]]:
    """Pure: move each lease's deadline to `sent_at + remaining` and its end to `answered_at +
    remaining` (the statement ran in between); returns (refused, newly cancelled)."""
    by_id = {row.run_id: row for row in renewed}
    refused, cancelled = [], []
    for lease in leases:
        row = by_id.get(lease.run_id)
        if row is None or not row.ours:
            lease.refused = True
            refused.append(lease)
            continue
        if row.remaining_s is None:
            continue
        lease.expires_at = max(lease.expires_at, sent_at + row.remaining_s)
        if answered_at is not None:
            lease.answered_by = max(lease.answered_by, answered_at + row.remaining_s)
        if row.cancel_requested and not lease.cancel_requested:
            lease.cancel_requested = True
            cancelled.append(lease)
    return refused, cancelled



@dataclass(frozen=True, slots=True)
class _Link:
    """A keeper connection and its renewal statement, prepared when it connected."""

    connection: Any              # asyncpg.Connection
    renew: Any                   # asyncpg.PreparedStatement of RENEW_SQL


@dataclass(slots=True)
class _Held:
    lease: Lease
    on_refused: Callable[[], None]     # called on the driver's loop
    on_cancel: Callable[[], None]


@dataclass(slots=True)
class LeaseKeeper:
    """Renews every lease of the process from its own thread, event loop and connection."""

    dsn: str
    lease_seconds: float
    interval_s: float
    on_renewed: Callable[[float], None] = lambda lag_s: None      # lag metric (thread-safe callee)
    on_failed: Callable[[], None] = lambda: None
    _held: dict[str, _Held] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = None          # the drivers' loop
    _beat: float = field(default_factory=time.monotonic)    # the drivers' loop's last heartbeat
    _own_loop: asyncio.AbstractEventLoop | None = None      # the keeper thread's loop
    _poke: asyncio.Event | None = None                      # set (thread-safely) by hold(): renew now
    _idle: _Link | None = None                              # the keeper's connection between renewals
    _heart: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Call on the drivers' event loop."""
        self._loop = asyncio.get_running_loop()
        self._heart = self._loop.create_task(self._heartbeat(), name="lease-heartbeat")
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        self._stopping.set()
        if self._heart is not None:
            self._heart.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heart
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    def hold(self, lease: Lease, on_refused: Callable[[], None], on_cancel: Callable[[], None]) -> None:
        """Renew `lease` from now on. A fresh claim's deadline was counted conservatively from before
        its transaction began: when that transaction took long enough that less than a lease minus
        one renewal interval (and at least two intervals) is left, the first renewal goes out at
        once; otherwise with the next regular one (within an interval), so a burst of claims adds no
        renewal statement per claim."""
        with self._guard:
            self._held[lease.run_id] = _Held(lease, on_refused, on_cancel)
        enough_s = max(self.lease_seconds - self.interval_s, 2 * self.interval_s)
        if lease.expires_at - time.monotonic() >= enough_s:
            return
        loop, poke = self._own_loop, self._poke
        if loop is not None and poke is not None:
            with contextlib.suppress(RuntimeError):     # the keeper's loop is closing
                loop.call_soon_threadsafe(poke.set)

    def release(self, run_id: str) -> None:
        with self._guard:
            self._held.pop(run_id, None)

    def _run(self) -> None:
        """The keeper thread: its loop is restarted should anything escape it (it must not die)."""
        while not self._stopping.is_set():
            try:
                asyncio.run(self._main())
            except BaseException:
                log.exception("lease keeper loop failed; restarting it")
                time.sleep(RETRY_S)

    async def _heartbeat(self) -> None:
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(HEARTBEAT_S)

    async def _main(self) -> None:
        due = time.monotonic()       # when the next renewal is owed (lag is measured from here)
        attempt = due                # when to renew next
        self._own_loop, self._poke = asyncio.get_running_loop(), asyncio.Event()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            self._idle = await self._connect()   # ready before the first lease arrives
        try:
            while not self._stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._poke.wait(), max(0.0, attempt - time.monotonic()))
                self._poke.clear()
                with self._guard:
                    held = list(self._held.values())
                if not held or time.monotonic() - self._beat > WEDGED_LEASES * self.lease_seconds:
                    due = attempt = time.monotonic() + self.interval_s
                    continue
                answer = await self._renewal([entry.lease for entry in held])
                if answer is None:           # stopping
                    break
                renewed, sent, answered = answer
                self.on_renewed(max(0.0, answered - due))
                if answered - sent > self.interval_s:
                    log.info("lease renewal of %d runs took %.2fs (%d skipped: rows locked), lag %.2fs",
                             len(held), answered - sent, sum(row.remaining_s is None for row in renewed),
                             answered - due)
                due = attempt = sent + self.interval_s
                self._deliver(held, renewed, sent, answered)
        finally:
            _terminated(self._idle)
            self._idle = None

    async def _renewal(self, leases: list[Lease]) -> tuple[list[Renewed], float, float] | None:
        """Renew `leases`: (rows, sent, answered) of the first attempt answered; None when stopping.
        No attempt is cut short while it may still save the leases (module doc): one unanswered after
        HEDGE_SHARE of the lease left is joined by another, on a fresh connection."""
        attempts: dict[asyncio.Task[tuple[_Link, list[Renewed]]], float] = {}   # attempt -> sent
        start_at = time.monotonic()
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                if now >= start_at and len(attempts) < MAX_ATTEMPTS:
                    link, self._idle = self._idle, None
                    attempts[asyncio.create_task(self._attempt(link, leases))] = now
                    left = min(lease.expires_at for lease in leases) - now
                    start_at = now + max(MIN_HEDGE_S, HEDGE_SHARE * left)
                wait = min(HEARTBEAT_S, max(0.0, start_at - time.monotonic()))
                if not attempts:
                    await asyncio.sleep(wait)
                    continue
                done, _ = await asyncio.wait(attempts, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                answered = time.monotonic()
                for task in done:
                    sent = attempts.pop(task)
                    error = task.exception()
                    if error is None:
                        link, rows = task.result()
                        if self._idle is None:
                            self._idle = link
                        else:
                            _terminated(link)
                        return rows, sent, answered
                    log.warning("lease renewal attempt failed (%r); retrying in %.1fs", error, RETRY_S)
                    self.on_failed()
                    start_at = min(start_at, answered + RETRY_S)
            return None
        finally:
            for task in attempts:
                task.cancel()
            await asyncio.gather(*attempts, return_exceptions=True)

    async def _attempt(self, link: _Link | None, leases: list[Lease]) -> tuple[_Link, list[Renewed]]:
        """One renewal statement, on `connection` or a fresh one (closed on failure). Not cut short
        while it may still answer: on a slow link, connecting alone takes several round trips."""
        limit = ATTEMPT_LEASES * self.lease_seconds
        try:
            async with asyncio.timeout(limit):
                if link is None:
                    link = await self._connect(limit)
                return link, await self._renew(link, leases)
        except BaseException:
            _terminated(link)
            raise

    async def _connect(self, limit: float | None = None) -> _Link:
        """A connection with the renewal statement prepared (its types looked up): on a connection
        made at start, while the database answers quickly, a first renewal then costs one round trip
        (unprepared, it cost several: a keeper starting as the database turned slow lost its leases)."""
        limit = limit or max(CONNECT_TIMEOUT_S, self.lease_seconds / 3)

        async def connected() -> _Link:
            connection = await asyncpg.connect(asyncpg_dsn(self.dsn), timeout=limit,
                                               server_settings={"application_name": APPLICATION_NAME},
                                               connection_class=KnownTypesConnection)
            try:
                return _Link(connection, await connection.prepare(RENEW_SQL))
            except BaseException:
                connection.terminate()
                raise
        return await asyncio.wait_for(connected(), limit * 2)

    async def _renew(self, link: _Link, leases: list[Lease]) -> list[Renewed]:
        rows = await link.renew.fetch(
            float(self.lease_seconds), [lease.run_id for lease in leases],
            [lease.epoch for lease in leases], [lease.last_sequence for lease in leases],
            [lease.output_tokens for lease in leases])
        return [Renewed(row["id"], row["ours"], bool(row["cancel_requested"]), row["remaining_s"])
                for row in rows]

    def _deliver(self, held: list[_Held], renewed: list[Renewed], sent: float, answered: float) -> None:
        refused, cancelled = apply_renewal([entry.lease for entry in held], renewed, sent, answered)
        callbacks = {id(entry.lease): entry for entry in held}
        assert self._loop is not None
        for lease in refused:
            with contextlib.suppress(RuntimeError):     # the drivers' loop is closing
                self._loop.call_soon_threadsafe(callbacks[id(lease)].on_refused)
        for lease in cancelled:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(callbacks[id(lease)].on_cancel)


def _terminated(link: _Link | None) -> None:
    """Close at once, without a round trip: the connection may be one that stopped answering."""
    if link is not None:
        with contextlib.suppress(Exception):
            link.connection.terminate()
