"""Runs.Stream's lookups as single autocommit statements (no BEGIN/ROLLBACK round trips).

    stream_lookup   API key → tenant, and that tenant's run with where its events start
    event_start     where a run's events start, re-read while a stream waits for them

An unknown key and another tenant's run are told apart as the ORM path does: no row at all is
an unknown (or revoked) key; a row without a run is a run this tenant does not have.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.ext.asyncio import AsyncConnection

_LOOKUP = text("""
SELECT r.id, r.event_partition, r.event_first_offset, r.terminal_sequence
FROM api_keys k
LEFT JOIN runs r ON r.id = :run_id AND r.tenant_id = k.tenant_id
WHERE k.key_hash = :key_hash AND k.revoked_at IS NULL
""").bindparams(bindparam("run_id", type_=UUID(as_uuid=True)))

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


async def stream_lookup(connection: AsyncConnection, key_hash: str, run_id: uuid.UUID | None) -> StreamLookup:
    row = (await connection.execute(_LOOKUP, {"key_hash": key_hash, "run_id": run_id})).first()
    if row is None:
        return StreamLookup(False, None, EventStart(None, None, None))
    return StreamLookup(True, row.id, EventStart(row.event_partition, row.event_first_offset,
                                                 row.terminal_sequence))


async def event_start(connection: AsyncConnection, run_id: uuid.UUID) -> EventStart:
    row = (await connection.execute(_START, {"run_id": run_id})).one()
    return EventStart(row.event_partition, row.event_first_offset, row.terminal_sequence)
