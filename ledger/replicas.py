"""The durable replica registry: rows every routing process follows (services/routing/registry_sync).

Config `[[replicas]]` stays the bootstrap; a row here overrides the configured replica of the same
name, and a removal is a tombstone row (`removed`), so a configured replica stays removed. Every
write takes a new `revision` from one sequence and NOTIFYs REPLICAS_CHANNEL at commit. A routing
process re-reads the whole (small) table when woken by the NOTIFY or, should one be lost, at its
next poll, and applies each row whose revision differs from the one it applied for that name.
(Not "revision > the highest seen": two writers can commit their revisions out of order.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from sluice.ledger.channels import REPLICAS_CHANNEL
from sluice.ledger.models import ReplicaRow
from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

FIELDS = ("name", "pool", "grpc_address", "metrics_url", "block_size", "kv_capacity_blocks", "long_context",
          "state")


class ReplicaFields(Protocol):
    """What a replica is, wherever it comes from (a row, a configured ReplicaSpec)."""

    @property
    def name(self) -> str: ...
    @property
    def pool(self) -> str: ...
    @property
    def grpc_address(self) -> str: ...
    @property
    def metrics_url(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def kv_capacity_blocks(self) -> int: ...
    @property
    def long_context(self) -> bool: ...
    @property
    def state(self) -> str: ...


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    name: str
    pool: str  # model version served ("" = every model)
    grpc_address: str
    metrics_url: str
    block_size: int
    kv_capacity_blocks: int
    long_context: bool
    state: str  # serving | warm | draining (sluice.router.registry): only serving takes new runs
    removed: bool  # a tombstone: routing processes drop the replica
    revision: int

    @classmethod
    def of(cls, row: ReplicaRow) -> ReplicaRecord:
        return cls(**fields_of(row), removed=row.removed, revision=row.revision)

    @classmethod
    def configured(cls, spec: ReplicaFields) -> ReplicaRecord:
        """A replica from config (`[[replicas]]`): live, never written (revision 0)."""
        return cls(**fields_of(spec), removed=False, revision=0)


def fields_of(replica: ReplicaFields) -> dict[str, Any]:
    return {name: getattr(replica, name) for name in FIELDS}


class ReplicaRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def get(self, name: str) -> ReplicaRecord | None:
        row = await self._session.scalar(select(ReplicaRow).where(ReplicaRow.name == name))
        return None if row is None else ReplicaRecord.of(row)

    async def put(self, replica: ReplicaFields, *, removed: bool = False) -> ReplicaRecord:
        """Write the replica's row (a tombstone when `removed`) under a new revision; NOTIFY."""
        name = replica.name
        values = {field: value for field, value in fields_of(replica).items() if field != "name"}
        values["removed"] = removed
        statement = pg_insert(ReplicaRow).values(name=name, **values)
        row = await self._session.scalar(
            statement.on_conflict_do_update(
                index_elements=[ReplicaRow.name],
                set_={
                    **values,
                    "revision": text("nextval('replicas_revision_seq')"),
                    "updated_at": func.now(),
                },
            )
            .returning(ReplicaRow)
            .execution_options(populate_existing=True)
        )
        assert row is not None
        await self._session.execute(select(func.pg_notify(REPLICAS_CHANNEL, name)))
        return ReplicaRecord.of(row)

    async def all(self) -> list[ReplicaRecord]:
        """Every row, tombstones included, by name."""
        rows = await self._session.scalars(select(ReplicaRow).order_by(ReplicaRow.name))
        return [ReplicaRecord.of(row) for row in rows]
