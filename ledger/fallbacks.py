"""Tenants' permitted fallbacks in the ledger (table tenant_fallbacks): what admission reads when a
submit would be refused for load, and what the Admin API sets.

Admission reads these only on the refusal path (a full backlog or a queue-bound deadline), so the
Submit hot path stays two statements.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.ledger.admission_sql import model_info_of
from sluice.ledger.models import Model, RunStatus, TenantFallback, unclaimed
from sluice.ledger.repositories import ModelInfo
from sqlalchemy import delete, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from sluice.traffic.fallback import Candidate, Condition, FallbackRule

_RULES = text("""
SELECT from_model, to_model, conditions FROM tenant_fallbacks
 WHERE tenant_id = :tenant_id AND from_model = ANY(:names)
 ORDER BY position
""")

# Each name as admission would resolve it (an exact version wins over an alias), with its backlog.
_CANDIDATES = text(f"""
SELECT n.name, m.*,
       (SELECT count(*) FROM (SELECT 1 FROM runs r
                              WHERE r.model_version = m.version AND r.status = '{RunStatus.ACCEPTED.value}'
                                AND {unclaimed("r.")}
                              LIMIT :backlog_limit) AS waiting) AS backlog
FROM unnest(CAST(:names AS text[])) AS n(name)
LEFT JOIN LATERAL (
    SELECT * FROM models WHERE (version = n.name OR alias = n.name) AND retired_at IS NULL
    ORDER BY version = n.name DESC LIMIT 1
) m ON true
""")


async def read_rules(connection: AsyncConnection, tenant_id: uuid.UUID,
                     names: Sequence[str]) -> list[FallbackRule]:
    """The tenant's rules for any of `names` (the requested name and the version it resolved to)."""
    rows = await connection.execute(_RULES, {"tenant_id": tenant_id, "names": list(names)})
    return [FallbackRule(row.from_model, row.to_model, frozenset(Condition(c) for c in row.conditions))
            for row in rows]


@dataclass(frozen=True, slots=True)
class ReadCandidate:
    candidate: Candidate
    model: ModelInfo | None          # None: no such model (or retired)


async def read_candidates(connection: AsyncConnection, names: Sequence[str],
                          backlog_limit: int) -> dict[str, ReadCandidate]:
    rows = await connection.execute(_CANDIDATES, {"names": list(names), "backlog_limit": backlog_limit})
    found: dict[str, ReadCandidate] = {}
    for row in rows:
        if row.version is None:
            found[row.name] = ReadCandidate(Candidate(row.name, None, "", 0, 0), None)
            continue
        model = model_info_of(row)
        found[row.name] = ReadCandidate(
            Candidate(row.name, row.version, row.quality_tier, row.context_limit, int(row.backlog)), model)
    return found


class FallbackAdmin:
    """The Admin API's side: a tenant's whole list, replaced at once."""

    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def get(self, tenant_id: uuid.UUID) -> list[FallbackRule]:
        rows = await self._session.scalars(
            select(TenantFallback).where(TenantFallback.tenant_id == tenant_id)
            .order_by(TenantFallback.position))
        return [FallbackRule(row.from_model, row.to_model, frozenset(Condition(c) for c in row.conditions))
                for row in rows]

    async def replace(self, tenant_id: uuid.UUID, rules: Sequence[FallbackRule]) -> None:
        await self._session.execute(delete(TenantFallback).where(TenantFallback.tenant_id == tenant_id))
        for position, rule in enumerate(rules):
            self._session.add(TenantFallback(
                tenant_id=tenant_id, from_model=rule.from_model, to_model=rule.to_model, position=position,
                conditions=sorted(c.value for c in rule.conditions)))
        await self._session.flush()

    async def known_model(self, name: str) -> bool:
        found = await self._session.scalar(
            select(Model.version).where((Model.version == name) | (Model.alias == name)).limit(1))
        return found is not None
