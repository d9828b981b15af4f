"""The run path's single-statement reads and writes, each one autocommit round trip (no BEGIN/COMMIT).

    stream_lookup     API key → tenant, and that tenant's run with where its events start (Runs.Stream)
    event_start       where a run's events start, re-read while a stream waits for them
    mark_running      QUEUED → RUNNING under the driver's lease epoch, with where its events start
    mark_published    the TERMINAL event is durable: the run's publisher lease ends

The two writes NOTIFY the run's Streams in their RETURNING clause (delivered at the statement's
commit), so a write and its notification are one round trip.

An unknown key and another tenant's run are told apart as the ORM path does: no row at all is
an unknown (or revoked) key; a row without a run is a run this tenant does not have.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sluice.ledger.pg import Executor, Statement, rows_of
from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.ext.asyncio import AsyncConnection

from sluice.eventlog.interface import LogPosition

_LOOKUP = text("""
SELECT r.id, r.event_partition, r.event_first_offset, r.terminal_sequence, r.traceparent
FROM api_keys k
LEFT JOIN runs r ON r.id = :run_id AND r.tenant_id = k.tenant_id
WHERE k.key_hash = :key_hash AND k.revoked_at IS NULL
""").bindparams(bindparam("run_id", type_=UUID(as_uuid=True)))

_MARK_RUNNING = Statement.of("""
UPDATE runs
   SET status = 'RUNNING', started_at = COALESCE(started_at, now()),
       event_partition = COALESCE(event_partition, :partition),
       event_first_offset = COALESCE(event_first_offset, :first_offset),
       last_sequence = GREATEST(last_sequence, :last_sequence)
 WHERE id = :run_id AND lease_epoch = :epoch AND status IN ('QUEUED', 'RUNNING')
RETURNING pg_notify(:channel, :payload)
""")

_MARK_PUBLISHED = Statement.of("""
UPDATE runs
   SET terminal_published = true, lease_expires_at = NULL,
       last_sequence = GREATEST(last_sequence, :sequence),
       event_partition = COALESCE(event_partition, :partition),
       event_first_offset = COALESCE(event_first_offset, :first_offset)
 WHERE id = :run_id
RETURNING pg_notify(:channel, :payload)
""")

_START = text("""
SELECT event_partition, event_first_offset, terminal_sequence FROM runs WHERE id = :run_id
""").bindparams(bindparam("run_id", type_=UUID(as_uuid=True)))


@dataclass(frozen=True, slots=True)
class EventStart:
    """The ledger's record of where a run's events are."""

    partition: int | None            # None until the first event's position is recorded
    first_offset: int | None
    terminal_sequence: int | None    # fixed with settlement, before the terminal event is published


@dataclass(frozen=True, slots=True)
class StreamLookup:
    authenticated: bool              # the key is known and not revoked
    run_id: uuid.UUID | None         # None: no such run for this key's tenant
    start: EventStart
    traceparent: str | None = None   # the run's trace (admission's span), for the stream's span


async def stream_lookup(connection: AsyncConnection, key_hash: str, run_id: uuid.UUID | None) -> StreamLookup:
    row = (await connection.execute(_LOOKUP, {"key_hash": key_hash, "run_id": run_id})).first()
    if row is None:
        return StreamLookup(False, None, EventStart(None, None, None))
    return StreamLookup(True, row.id, EventStart(row.event_partition, row.event_first_offset,
                                                 row.terminal_sequence), row.traceparent)


async def event_start(connection: AsyncConnection, run_id: uuid.UUID) -> EventStart:
    row = (await connection.execute(_START, {"run_id": run_id})).one()
    return EventStart(row.event_partition, row.event_first_offset, row.terminal_sequence)


async def mark_running(connection: Executor, run_id: str, epoch: int, first: LogPosition,
                       last_sequence: int, channel: str) -> bool:
    """QUEUED → RUNNING with where the run's events start; False if the lease of `epoch` is gone.
    Idempotent (a retry after a lost acknowledgment finds it RUNNING under the same epoch). Streams
    waiting for the run's first event are notified on `channel` when it commits."""
    row = await rows_of(connection).row(_MARK_RUNNING, {
        "run_id": uuid.UUID(run_id), "epoch": epoch, "partition": first.partition,
        "first_offset": first.offset, "last_sequence": last_sequence, "channel": channel,
        "payload": run_id})
    return row is not None


async def mark_published(connection: Executor, run_id: str, sequence: int,
                         position: LogPosition, channel: str) -> None:
    """The TERMINAL event (`sequence`, at `position`) is durable: record it, end the publisher's lease.
    A run whose only event is its terminal one starts where that event sits."""
    await rows_of(connection).row(_MARK_PUBLISHED, {
        "run_id": uuid.UUID(run_id), "sequence": sequence, "partition": position.partition,
        "first_offset": position.offset, "channel": channel, "payload": run_id})
