"""UsageService.QueryUsage and Reconcile: finance's reads over every tenant.

Who may read what (DESIGN.md "Keys and scopes"):

    finance, admin key   every tenant, or the one named
    tenant key           its own tenant only; naming another → PERMISSION_DENIED
    Reconcile            finance or admin keys only

Both read in one REPEATABLE READ transaction, so groups, in-flight sums and every
reconciliation check see the same snapshot (a run settling meanwhile is on one side only).
"""

from __future__ import annotations

import base64
import datetime as dt
import re
from dataclasses import dataclass

from sluice.ledger.admin import TenantAdmin
from sluice.ledger.finance import GROUP_KEYS, TIME_KEYS, UsageGroup, UsageQuery, grouped_usage
from sluice.ledger.models import KeyScope
from sluice.ledger.reconcile import Reconciliation, reconcile
from sluice.ledger.repositories import InFlightTotals, RunRepository, current_period_start
from sluice.services.admin import UNKNOWN_TENANT, parse_period
from sluice.services.auth import Metadata, identify, require_scope
from sluice.services.errors import InvalidArgument, NotFound, PermissionDenied
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

CROSS_TENANT_USAGE = (
    "a tenant API key reads only its own tenant's usage (asked for {asked!r}): use a finance key"
)
BAD_GROUP_KEY = "cannot group by {key!r}: use any of " + ", ".join(GROUP_KEYS)
TWO_TIME_KEYS = "group by day or by hour, not both"
BAD_BUCKET = "bucket {value!r} is not a width like 15m, 6h or 7d"
BUCKET_WITHOUT_TIME = "a bucket width needs group_by day or hour"
BAD_TIME = "{field} {value!r} is not an ISO date or date-time"
MISSING_TIME = "{field} is required: an ISO date (YYYY-MM-DD) or date-time"
EMPTY_RANGE = "from {start} is not before to {end}"
BAD_PAGE_TOKEN = "page_token {value!r} is not one this service returned: start again without it"

DEFAULT_PAGE_SIZE = 1_000
MAX_PAGE_SIZE = 10_000
_WIDTH = re.compile(r"^(\d+)([mhd])$")
_UNITS = {"m": dt.timedelta(minutes=1), "h": dt.timedelta(hours=1), "d": dt.timedelta(days=1)}
_DEFAULT_BUCKET = {"hour": dt.timedelta(hours=1), "day": dt.timedelta(days=1)}


@dataclass(frozen=True, slots=True)
class UsagePage:
    groups: tuple[UsageGroup, ...]
    next_page_token: str  # "" on the last page
    in_flight: InFlightTotals


def parse_instant(field: str, value: str, *, end: bool) -> dt.datetime:
    """An ISO date or date-time as a UTC instant. A date as `end` is the midnight after it, so
    `--to 2026-11-30` includes that whole day; a date-time is taken as it is (exclusive)."""
    if not value:
        raise InvalidArgument(MISSING_TIME.format(field=field))
    try:
        if len(value) == 10:
            day = dt.date.fromisoformat(value)
            start = dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)
            return start + dt.timedelta(days=1) if end else start
        instant = dt.datetime.fromisoformat(value)
    except ValueError:
        raise InvalidArgument(BAD_TIME.format(field=field, value=value)) from None
    return instant.replace(tzinfo=dt.UTC) if instant.tzinfo is None else instant.astimezone(dt.UTC)


def parse_group_by(keys: list[str], bucket: str) -> tuple[tuple[str, ...], dt.timedelta | None]:
    group_by = tuple(dict.fromkeys(key.strip().lower() for key in keys if key.strip()))
    for key in group_by:
        if key not in GROUP_KEYS:
            raise InvalidArgument(BAD_GROUP_KEY.format(key=key))
    time_keys = [key for key in group_by if key in TIME_KEYS]
    if len(time_keys) > 1:
        raise InvalidArgument(TWO_TIME_KEYS)
    if not time_keys:
        if bucket:
            raise InvalidArgument(BUCKET_WITHOUT_TIME)
        return group_by, None
    if not bucket:
        return group_by, _DEFAULT_BUCKET[time_keys[0]]
    match = _WIDTH.match(bucket.strip())
    if match is None or int(match.group(1)) == 0:
        raise InvalidArgument(BAD_BUCKET.format(value=bucket))
    return group_by, int(match.group(1)) * _UNITS[match.group(2)]


def encode_page_token(offset: int) -> str:
    return base64.urlsafe_b64encode(f"o{offset}".encode()).decode()


def decode_page_token(token: str) -> int:
    if not token:
        return 0
    try:
        text = base64.urlsafe_b64decode(token.encode()).decode()
        if text[0] == "o" and text[1:].isdigit():
            return int(text[1:])
    except (ValueError, UnicodeDecodeError, IndexError):
        pass
    raise InvalidArgument(BAD_PAGE_TOKEN.format(value=token))


class FinanceService:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def query(
        self,
        metadata: Metadata,
        start: str,
        end: str,
        group_by: list[str],
        bucket: str,
        tenant: str,
        page_size: int,
        page_token: str,
    ) -> UsagePage:
        window = (parse_instant("from", start, end=False), parse_instant("to", end, end=True))
        if window[0] >= window[1]:
            raise InvalidArgument(EMPTY_RANGE.format(start=window[0].isoformat(), end=window[1].isoformat()))
        keys, width = parse_group_by(group_by, bucket)
        limit = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        offset = decode_page_token(page_token)
        async with self._sessionmaker() as session, session.begin():
            await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
            caller = await identify(session, metadata)
            if caller.tenant is not None:
                if tenant and tenant != caller.tenant.name:
                    raise PermissionDenied(CROSS_TENANT_USAGE.format(asked=tenant))
                tenant_id = caller.tenant.id
            elif tenant:
                found = await TenantAdmin(session).by_name(tenant)
                if found is None:
                    raise NotFound(UNKNOWN_TENANT.format(name=tenant))
                tenant_id = found.id
            else:
                require_scope(caller, "usage of every tenant", KeyScope.FINANCE, KeyScope.ADMIN)
                tenant_id = None
            groups, more = await grouped_usage(
                session,
                UsageQuery(
                    start=window[0],
                    end=window[1],
                    group_by=keys,
                    bucket=width,
                    tenant_id=tenant_id,
                    limit=limit,
                    offset=offset,
                ),
            )
            in_flight = await RunRepository(session).in_flight_totals(tenant_id)
        return UsagePage(tuple(groups), encode_page_token(offset + limit) if more else "", in_flight)

    async def reconcile(self, metadata: Metadata, period: str) -> Reconciliation:
        period_start = parse_period(period)
        async with self._sessionmaker() as session, session.begin():
            await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
            caller = await identify(session, metadata)
            require_scope(caller, "reconciliation", KeyScope.FINANCE, KeyScope.ADMIN)
            if period_start is None:
                period_start = await session.scalar(select(current_period_start()))
                assert period_start is not None
            return await reconcile(session, period_start)
