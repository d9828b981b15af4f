"""The admin audit trail: one row per change (who, what, before, after, when).

`record` is called inside the transaction that makes the change, so the change and its row commit
or roll back together. Before/after are the frozen records the admin repositories return, turned
into JSON here (datetimes as ISO strings, UUIDs as strings, tuples as lists).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import uuid
from dataclasses import dataclass
from typing import Any

from sluice.ledger.models import AuditEntry
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession


@dataclass(frozen=True, slots=True)
class Actor:
    key_id: uuid.UUID | None  # None for changes made outside the API (the seed)
    key_prefix: str


@dataclass(frozen=True, slots=True)
class AuditRecord:
    id: int
    at: dt.datetime
    actor: str  # the acting key's prefix
    action: str
    target: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None


def jsonable(value: Any) -> Any:
    """A record (dataclass) or value as JSON-ready data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: jsonable(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


async def record(
    session: AsyncSession, actor: Actor, action: str, target: str, before: Any, after: Any
) -> None:
    session.add(
        AuditEntry(
            actor_key_id=actor.key_id,
            actor_key_prefix=actor.key_prefix,
            action=action,
            target=target,
            before=jsonable(before),
            after=jsonable(after),
        )
    )
    await session.flush()


async def recent(session: AsyncSession, limit: int, action: str | None = None) -> list[AuditRecord]:
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if action:
        query = query.where(AuditEntry.action == action)
    return [
        AuditRecord(
            id=row.id,
            at=row.at,
            actor=row.actor_key_prefix,
            action=row.action,
            target=row.target,
            before=row.before,
            after=row.after,
        )
        for row in await session.scalars(query)
    ]
