"""Finance's view of settled usage: usage entries grouped by tenant, key, model and time bucket.

Only usage_entries are summed (one per terminal run, written by settlement), so every figure is
settled; reservations of runs still in flight are reported apart. Time is the entry's
`settled_at`, bucketed by `date_bin` from midnight UTC, so a 1-day bucket is the UTC day.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from sluice.ledger.models import ApiKey, Tenant, UsageEntry
from sqlalchemy import func, literal, select
from sqlalchemy.ext.asyncio import AsyncSession

GROUP_KEYS = ("tenant", "api_key", "model", "route", "pool", "tier", "day", "hour")
# The routing decision's columns on usage entries ("" for entries settled before they existed).
_ROUTE_COLUMNS = {"route": UsageEntry.route_reason, "pool": UsageEntry.worker_pool,
                  "tier": UsageEntry.quality_tier}
TIME_KEYS = frozenset({"day", "hour"})
BUCKET_ORIGIN = dt.datetime(
    2000, 1, 3, tzinfo=dt.UTC
)  # a Monday, midnight UTC: 7-day buckets start on Mondays


@dataclass(frozen=True, slots=True)
class UsageQuery:
    start: dt.datetime  # settled_at >= start
    end: dt.datetime  # settled_at < end
    group_by: tuple[str, ...]  # of GROUP_KEYS, in the order asked
    bucket: dt.timedelta | None  # width of the time bucket when grouped by day or hour
    tenant_id: uuid.UUID | None  # only this tenant; None = every tenant
    limit: int  # groups per page
    offset: int


@dataclass(frozen=True, slots=True)
class UsageGroup:
    tenant: str | None  # each key is None unless grouped by it
    api_key: str | None  # the submitting key's prefix ("" for runs without one)
    model_version: str | None
    bucket_start: dt.datetime | None
    route: str | None                # the routing reason (requested | alias | canary | fallback)
    pool: str | None
    tier: str | None
    runs: int
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    cost_micros: int


def _group_columns(query: UsageQuery) -> dict[str, Any]:
    columns: dict[str, Any] = {}
    for key in query.group_by:
        if key == "tenant":
            columns[key] = Tenant.name
        elif key == "api_key":
            columns[key] = func.coalesce(ApiKey.key_prefix, literal(""))
        elif key == "model":
            columns[key] = UsageEntry.model_version
        elif key in _ROUTE_COLUMNS:
            columns[key] = func.coalesce(_ROUTE_COLUMNS[key], literal(""))
        else:
            assert query.bucket is not None, "a time grouping needs a bucket width"
            columns["bucket"] = func.date_bin(query.bucket, UsageEntry.settled_at, BUCKET_ORIGIN)
    return columns


async def grouped_usage(session: AsyncSession, query: UsageQuery) -> tuple[list[UsageGroup], bool]:
    """One page of groups, ordered by the group columns, and whether another page follows."""
    columns = _group_columns(query)
    labelled = [column.label(name) for name, column in columns.items()]
    statement = (
        select(
            *labelled,
            func.count(),
            func.sum(UsageEntry.input_tokens),
            func.sum(UsageEntry.cached_input_tokens),
            func.sum(UsageEntry.output_tokens),
            func.sum(UsageEntry.cost_micros),
        )
        .select_from(UsageEntry)
        .join(Tenant, Tenant.id == UsageEntry.tenant_id)
        .outerjoin(ApiKey, ApiKey.id == UsageEntry.api_key_id)
        .where(UsageEntry.settled_at >= query.start, UsageEntry.settled_at < query.end)
        .limit(query.limit + 1)
        .offset(query.offset)
    )
    if query.tenant_id is not None:
        statement = statement.where(UsageEntry.tenant_id == query.tenant_id)
    if columns:
        statement = statement.group_by(*columns.values()).order_by(*columns.values())
    rows = (await session.execute(statement)).all()
    groups = [_group(columns, row) for row in rows[: query.limit]]
    return groups, len(rows) > query.limit


def _group(columns: dict[str, Any], row: Any) -> UsageGroup:
    keys = dict(zip(columns, row, strict=False))
    runs, inputs, cached, outputs, cost = row[len(columns) :]
    return UsageGroup(
        tenant=keys.get("tenant"),
        api_key=keys.get("api_key"),
        model_version=keys.get("model"),
        bucket_start=keys.get("bucket"),
        route=keys.get("route"),
        pool=keys.get("pool"),
        tier=keys.get("tier"),
        runs=int(runs),
        input_tokens=int(inputs or 0),
        cached_input_tokens=int(cached or 0),
        output_tokens=int(outputs or 0),
        cost_micros=int(cost or 0),
    )
