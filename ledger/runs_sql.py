"""The run path's single-statement reads and writes, each one autocommit round trip (no BEGIN/COMMIT).

    stream_lookup     API key → tenant, and that tenant's run with where its events start (Runs.Stream)
    event_start       where a run's events start, re-read while a stream waits for them
    mark_running      QUEUED → RUNNING under the driver's lease epoch (with where its events start,
                      when known)
    record_starts     where RUNNING runs' events start, once their first event is durable
    mark_published    the TERMINAL event is durable: the run's publisher lease ends

The writes take many runs in one statement (*_many; the routing worker batches them,
ledger/batching.py). RUNNING and published marks NOTIFY the run's Streams in their RETURNING clause
(delivered at the statement's commit), so a write and its notification are one round trip.
mark_published notifies only for a run that never went RUNNING (cancelled or ended before its first
event): a Stream waits for a NOTIFY only while the run's start is unrecorded, and RUNNING's own
NOTIFY already ended that wait for every other run. A NOTIFY wakes every listening backend of the
database and reaches every gateway's listener: one per run fewer (issue 9).

The routing worker commits RUNNING while the run's first events travel to the event log, not after
(a Stream holds the first event until RUNNING is committed: DESIGN.md, durable before told), and
records where they start in a second write once they are durable (record_starts). That write does
not NOTIFY, for the same reason: a Stream that finds the run RUNNING without a recorded start
re-reads it shortly instead (services/runs.py, START_POLL_S).

An unknown key and another tenant's run are told apart as the ORM path does: no row at all is
an unknown (or revoked, or expired) key; a row without a run is a run this tenant does not have.
The key is found as ApiKeyRepository.caller finds it: an unsalted key by its hash, a salted one
(the Admin API's) by its public prefix, then checked against its salted hash in Python.

The two reads run on a raw asyncpg connection (the gateway's HotPool), the writes on the
routing worker's: each statement prepared once per connection (ledger/pg.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.ledger.keys import matches, salted_prefix, unsalted_hash
from sluice.ledger.models import KeyScope
from sluice.ledger.pg import Executor, Statement, rows_of

from sluice.eventlog.interface import LogPosition

_LOOKUP = Statement.of("""
SELECT k.key_hash, k.key_salt, k.scope,
       r.id, r.event_partition, r.event_first_offset, r.terminal_sequence, r.traceparent,
       r.started_at IS NOT NULL AS started
FROM api_keys k
LEFT JOIN runs r ON r.id = :run_id AND r.tenant_id = k.tenant_id
WHERE ((k.key_hash = :key_hash AND k.key_salt IS NULL)
       OR (k.key_prefix = :key_prefix AND k.key_salt IS NOT NULL))
  AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now())
""")

# Each write takes many runs at once (ledger/batching.py: the routing worker's runs reach each step
# together), one row of `unnest` per run, one round trip and one commit for all of them. Each row
# carries its own lease epoch (RUNNING) and its own NOTIFY (a transaction's notifications reach the
# listeners together, at its commit). `id = ANY(ids)` beside the join keeps the prepared statement's
# generic plan on the primary key: joined to `unnest` alone (10 rows assumed), runs was scanned whole.
# Where the runs' events start and their last durable sequence, one row of `unnest` per run under
# its epoch: shared by the RUNNING mark and the start recorded after it.
_START_SET = """
       event_partition = COALESCE(r.event_partition, p.partition),
       event_first_offset = COALESCE(r.event_first_offset, p.first_offset),
       last_sequence = GREATEST(r.last_sequence, p.last_sequence)
  FROM unnest(CAST(:run_ids AS uuid[]), CAST(:epochs AS bigint[]), CAST(:partitions AS integer[]),
              CAST(:first_offsets AS bigint[]), CAST(:last_sequences AS bigint[]))
       AS p(run_id, epoch, partition, first_offset, last_sequence), locked
 WHERE r.id = ANY(CAST(:run_ids AS uuid[])) AND r.id = p.run_id AND r.id = locked.id
   AND r.lease_epoch = p.epoch"""
# Every batched write locks its runs in id order before it changes them, as the settlement does
# (ledger/settlement.py: ORDER BY r.id FOR UPDATE OF r): two batches that share runs then queue at
# the first one they share, never each holding a run the other waits for. The UPDATE's own join
# meets the rows in whatever order its plan gives (the batch's, the index's): a batched start record
# and a batched settlement deadlocked so under load, and the settlement's driver gave its run up
# INTERRUPTED (bench-platform's run-cost phase, 3 runs of 600). NO KEY UPDATE is what the UPDATE
# takes anyway (an insert referencing the run still gets its key-share lock). Read by the join, the
# CTE is run (and its locks taken) in id order whichever side of the join it is on.
_LOCKED_IN_ID_ORDER = """
WITH locked AS MATERIALIZED (
    SELECT id FROM runs WHERE id = ANY(CAST(:run_ids AS uuid[])) ORDER BY id FOR NO KEY UPDATE
)"""
_MARK_RUNNING_MANY = Statement.of(f"""{_LOCKED_IN_ID_ORDER}
UPDATE runs AS r
   SET status = 'RUNNING', started_at = COALESCE(r.started_at, now()),{_START_SET}
   AND r.status IN ('QUEUED', 'RUNNING')
RETURNING r.id, pg_notify(:channel, CAST(r.id AS text))
""")

# Where RUNNING runs' events start (each under its driver's epoch), without a NOTIFY: their Streams
# were told RUNNING by mark_running's, and one that needs the start re-reads it (services/runs.py).
_RECORD_STARTS = Statement.of(f"""{_LOCKED_IN_ID_ORDER}
UPDATE runs AS r
   SET {_START_SET.lstrip()}
RETURNING r.id
""")

_MARK_PUBLISHED_MANY = Statement.of(f"""{_LOCKED_IN_ID_ORDER}
UPDATE runs AS r
   SET terminal_published = true, lease_expires_at = NULL,
       last_sequence = GREATEST(r.last_sequence, p.sequence),
       event_partition = COALESCE(r.event_partition, p.partition),
       event_first_offset = COALESCE(r.event_first_offset, p.first_offset)
  FROM unnest(CAST(:run_ids AS uuid[]), CAST(:sequences AS bigint[]), CAST(:partitions AS integer[]),
              CAST(:first_offsets AS bigint[]))
       AS p(run_id, sequence, partition, first_offset), locked
 WHERE r.id = ANY(CAST(:run_ids AS uuid[])) AND r.id = p.run_id AND r.id = locked.id
RETURNING CASE WHEN r.started_at IS NULL THEN pg_notify(:channel, CAST(r.id AS text)) END
""")

_START = Statement.of("""
SELECT event_partition, event_first_offset, terminal_sequence, started_at IS NOT NULL AS started
  FROM runs WHERE id = :run_id
""")


@dataclass(frozen=True, slots=True)
class EventStart:
    """The ledger's record of where a run's events are."""

    partition: int | None            # None until the first event's position is recorded
    first_offset: int | None
    terminal_sequence: int | None    # fixed with settlement, before the terminal event is published
    started: bool = False            # RUNNING recorded (its start may follow a moment later)


@dataclass(frozen=True, slots=True)
class RunningMark:
    """One run's QUEUED → RUNNING, as its driver asks for it (mark_running)."""

    run_id: str
    epoch: int                       # the driver's lease epoch: another epoch's row is not changed
    first: LogPosition | None        # where the run's events start (its STATUS RUNNING event); None:
                                     # not durable yet (record_starts writes it)
    last_sequence: int


@dataclass(frozen=True, slots=True)
class PublishedMark:
    """One run's TERMINAL event is durable (mark_published)."""

    run_id: str
    sequence: int                    # the TERMINAL event's
    position: LogPosition            # where it sits (the run's start, when it is its only event)


@dataclass(frozen=True, slots=True)
class StreamLookup:
    authenticated: bool              # the key is known, not revoked and not expired
    run_id: uuid.UUID | None         # None: no such run for this key's tenant
    start: EventStart
    traceparent: str | None = None   # the run's trace (admission's span), for the stream's span
    scope: KeyScope = KeyScope.TENANT   # the key's (a finance or admin key has no runs of its own)


async def stream_lookup(connection: Executor, key: str, run_id: uuid.UUID | None) -> StreamLookup:
    rows = await rows_of(connection).rows(_LOOKUP, {"key_hash": unsalted_hash(key),
                                                    "key_prefix": salted_prefix(key), "run_id": run_id})
    row = next((row for row in rows if matches(key, row["key_hash"], row["key_salt"])), None)
    if row is None:
        return StreamLookup(False, None, EventStart(None, None, None))
    return StreamLookup(True, row["id"], EventStart(row["event_partition"], row["event_first_offset"],
                                                    row["terminal_sequence"], bool(row["started"])),
                        row["traceparent"], KeyScope(row["scope"]))


async def event_start(connection: Executor, run_id: uuid.UUID) -> EventStart:
    row = await rows_of(connection).row(_START, {"run_id": run_id})
    assert row is not None, f"run {run_id} vanished"
    return EventStart(row["event_partition"], row["event_first_offset"], row["terminal_sequence"],
                      row["started"])


async def mark_running(connection: Executor, run_id: str, epoch: int, first: LogPosition | None,
                       last_sequence: int, channel: str) -> bool:
    """QUEUED → RUNNING with where the run's events start; False if the lease of `epoch` is gone.
    Idempotent (a retry after a lost acknowledgment finds it RUNNING under the same epoch). Streams
    waiting for the run's first event are notified on `channel` when it commits."""
    marks = [RunningMark(run_id, epoch, first, last_sequence)]
    return (await mark_running_many(connection, marks, channel))[0]


async def mark_running_many(connection: Executor, marks: Sequence[RunningMark], channel: str) -> list[bool]:
    """mark_running for every mark in one statement: per mark, whether its run is now RUNNING under
    its epoch (False: that lease is gone)."""
    rows = await rows_of(connection).rows(_MARK_RUNNING_MANY, {**_marks_columns(marks), "channel": channel})
    running = {str(row["id"]) for row in rows}
    return [mark.run_id in running for mark in marks]


async def record_starts(connection: Executor, marks: Sequence[RunningMark]) -> list[bool]:
    """Where each mark's run's events start (mark.first), in one statement; per mark, whether its
    run is still under its epoch. Nobody is notified."""
    assert all(mark.first is not None for mark in marks), "a start to record needs its position"
    rows = await rows_of(connection).rows(_RECORD_STARTS, _marks_columns(marks))
    recorded = {str(row["id"]) for row in rows}
    return [mark.run_id in recorded for mark in marks]


def _marks_columns(marks: Sequence[RunningMark]) -> dict[str, list[object]]:
    return {"run_ids": [uuid.UUID(mark.run_id) for mark in marks], "epochs": [mark.epoch for mark in marks],
            "partitions": [None if mark.first is None else mark.first.partition for mark in marks],
            "first_offsets": [None if mark.first is None else mark.first.offset for mark in marks],
            "last_sequences": [mark.last_sequence for mark in marks]}


async def mark_published_many(connection: Executor, marks: Sequence[PublishedMark], channel: str) -> None:
    """mark_published for every mark in one statement."""
    await rows_of(connection).rows(_MARK_PUBLISHED_MANY, {
        "run_ids": [uuid.UUID(mark.run_id) for mark in marks], "sequences": [mark.sequence for mark in marks],
        "partitions": [mark.position.partition for mark in marks],
        "first_offsets": [mark.position.offset for mark in marks], "channel": channel})


async def mark_published(connection: Executor, run_id: str, sequence: int,
                         position: LogPosition, channel: str) -> None:
    """The TERMINAL event (`sequence`, at `position`) is durable: record it, end the publisher's lease.
    A run whose only event is its terminal one starts where that event sits; its Streams are notified
    on `channel` (a run that went RUNNING notified them then)."""
    await mark_published_many(connection, [PublishedMark(run_id, sequence, position)], channel)
