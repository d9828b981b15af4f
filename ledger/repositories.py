"""Small repositories, each made from the session it is given.

They never commit or roll back: the transaction belongs to the service code that opened it, so a
reader sees every boundary there. Lookups that cross into services return frozen dataclasses.

Budget periods are derived from the DATABASE clock (`now()`, the transaction's start time), the
same clock that stamps `runs.created_at`, so admission (which reserves in the current period) and
settlement (which releases from the period of `runs.created_at`) always agree on the row, even for
a run admitted a moment before midnight at the end of a month.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from sluice.ledger.keys import matches, salted_prefix, unsalted_hash
from sluice.ledger.models import ACTIVE_STATUSES, ApiKey, Budget, KeyScope, Model, Run, RunStatus, Tenant
from sqlalchemy import (
    ColumnElement,
    Date,
    Interval,
    cast,
    func,
    literal_column,
    or_,
    select,
    type_coerce,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Result
from sqlalchemy.ext.asyncio import AsyncSession


def hash_api_key(key: str) -> str:
    """sha256 hex of an API key: what api_keys.key_hash stores for a key without salt (seeded and
    test keys; the Admin API makes salted keys, ledger/keys.py)."""
    return unsalted_hash(key)


def current_period_start() -> ColumnElement[dt.date]:
    """First day of the current UTC month, on the database clock."""
    return period_start_of(func.now())


def period_start_of(timestamp: Any) -> ColumnElement[dt.date]:
    """First day of the UTC month containing `timestamp` (a timestamptz expression or value)."""
    return cast(func.date_trunc("month", func.timezone("UTC", timestamp)), Date)


@dataclass(frozen=True, slots=True)
class TenantInfo:
    id: uuid.UUID
    name: str
    allowed_tiers: tuple[str, ...]  # quality tiers of models this tenant may use
    max_concurrent_runs: int | None = None  # runs not yet terminal; None = unlimited
    tokens_per_minute: int | None = None    # prompt + cap admitted per sliding 60 s; None = unlimited
    shared_cache_scope: str | None = None   # the shared prefix-cache scope opted into; None = own
    suspended: bool = False                 # an admin suspended it: Submit is refused
    api_key_id: uuid.UUID | None = None     # the key the caller authenticated with (runs record it)
    batch_allowed: bool = False             # may submit priority=batch runs
    kv_token_budget: int | None = None      # GPU-memory budget in KV tokens; None = no cap

    @property
    def has_rate_limits(self) -> bool:
        return self.max_concurrent_runs is not None or self.tokens_per_minute is not None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    version: str
    alias: str | None
    tokenizer: str                   # tokenizer.json path, relative to the repo root
    context_limit: int               # prompt + output cap must fit
    worker_pool: str
    quality_tier: str
    end_id: int
    price_input_per_m_micros: int    # price card, micro-USD per million tokens
    price_cached_input_per_m_micros: int
    price_output_per_m_micros: int
    price_card_id: int | None = None  # the card these prices are; a run is pinned to it

    @classmethod
    def of(cls, model: Model) -> ModelInfo:
        return cls(
            version=model.version,
            alias=model.alias,
            tokenizer=model.tokenizer,
            context_limit=model.context_limit,
            worker_pool=model.worker_pool,
            quality_tier=model.quality_tier,
            end_id=model.end_id,
            price_input_per_m_micros=model.price_input_per_m_micros,
            price_cached_input_per_m_micros=model.price_cached_input_per_m_micros,
            price_output_per_m_micros=model.price_output_per_m_micros,
            price_card_id=model.price_card_id,
        )


@dataclass(frozen=True, slots=True)
class BudgetState:
    period_start: dt.date
    token_budget: int
    cost_budget_micros: int
    reserved_tokens: int
    used_tokens: int
    reserved_cost_micros: int
    used_cost_micros: int

    @classmethod
    def of(cls, budget: Budget) -> BudgetState:
        return cls(
            period_start=budget.period_start,
            token_budget=budget.token_budget,
            cost_budget_micros=budget.cost_budget_micros,
            reserved_tokens=budget.reserved_tokens,
            used_tokens=budget.used_tokens,
            reserved_cost_micros=budget.reserved_cost_micros,
            used_cost_micros=budget.used_cost_micros,
        )

    @property
    def tokens_left(self) -> int:
        return self.token_budget - self.reserved_tokens - self.used_tokens

    @property
    def cost_left_micros(self) -> int:
        return self.cost_budget_micros - self.reserved_cost_micros - self.used_cost_micros


@dataclass(frozen=True, slots=True)
class LimitUsage:
    active_runs: int                 # runs not yet terminal
    tokens_in_window: int            # prompt + cap reserved by runs admitted within the window


@dataclass(frozen=True, slots=True)
class WindowEntry:
    age: dt.timedelta                # how long ago the run was admitted (database clock)
    tokens: int                      # what it reserved: prompt + output cap


@dataclass(frozen=True, slots=True)
class InFlightTotals:
    runs: int                        # non-terminal runs
    reserved_tokens: int             # their reservations, not yet settled
    reserved_cost_micros: int


class TenantRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def by_api_key(self, key: str) -> TenantInfo | None:
        """The tenant owning a valid (unrevoked, unexpired) tenant-scoped key, or None."""
        caller = await ApiKeyRepository(self._session).caller(key)
        return None if caller is None else caller.tenant

    async def lock_for_admission(self, tenant_id: uuid.UUID) -> None:
        """Serialize this tenant's limit checks across every admission instance until COMMIT.

        FOR NO KEY UPDATE, not FOR UPDATE: it must not block the FOR KEY SHARE lock that inserting
        a run (a foreign key to this row) takes, or concurrent submits would deadlock.
        """
        await self._session.execute(
            select(Tenant.id).where(Tenant.id == tenant_id).with_for_update(key_share=True)
        )


@dataclass(frozen=True, slots=True)
class ModelCard:
    """A model as the HTTP edge lists it and renders chat requests for it."""

    version: str
    alias: str | None
    context_limit: int
    quality_tier: str
    chat_template: str | None        # Jinja text; None: plain completions only


_CARD_COLUMNS = (Model.version, Model.alias, Model.context_limit, Model.quality_tier, Model.chat_template)


class ModelRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def cards(self) -> list[ModelCard]:
        rows = (await self._session.execute(
            select(*_CARD_COLUMNS).where(Model.retired_at.is_(None)).order_by(Model.version))).all()
        return [ModelCard(*row) for row in rows]

    async def card(self, name: str) -> ModelCard | None:
        """The model named by version or alias (an exact version wins, as in admission)."""
        rows = (await self._session.execute(
            select(*_CARD_COLUMNS).where(or_(Model.version == name, Model.alias == name),
                                         Model.retired_at.is_(None)))).all()
        if not rows:
            return None
        return ModelCard(*next((row for row in rows if row[0] == name), rows[0]))


class RunRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def insert_if_absent(self, values: dict[str, Any],
                               notify: tuple[str, str] | None = None) -> uuid.UUID | None:
        """INSERT the run unless (tenant_id, request_key) exists; its id, or None on conflict.

        A concurrent duplicate blocks on the unique index until the first transaction ends, then
        sees the committed row (None here) or, if that transaction rolled back, inserts itself.

        `notify` = (channel, payload): pg_notify in the RETURNING clause, so it fires only when a
        row is inserted, without a round trip of its own. Like any NOTIFY it is delivered at
        COMMIT and discarded if the transaction rolls back (e.g. the reservation is refused).
        """
        returning: list[Any] = [Run.id]
        if notify is not None:
            returning.append(func.pg_notify(*notify))
        statement = (
            pg_insert(Run)
            .values(**values)
            .on_conflict_do_nothing(index_elements=[Run.tenant_id, Run.request_key])
            .returning(*returning)
        )
        row = (await self._session.execute(statement)).first()
        return None if row is None else row[0]

    async def by_request_key(self, tenant_id: uuid.UUID, request_key: str) -> Run | None:
        return await self._session.scalar(
            select(Run).where(Run.tenant_id == tenant_id, Run.request_key == request_key)
        )

    async def get_for_tenant(self, tenant_id: uuid.UUID, run_id: uuid.UUID, *,
                             lock: bool = False) -> Run | None:
        """The run if it belongs to `tenant_id`; another tenant's run is indistinguishable from none.
        `lock`: row-locked (FOR UPDATE) until the caller's transaction ends."""
        query = select(Run).where(Run.id == run_id, Run.tenant_id == tenant_id)
        return await self._session.scalar(query.with_for_update() if lock else query)

    async def limit_usage(self, tenant_id: uuid.UUID, window: dt.timedelta,
                          excluding: uuid.UUID) -> LimitUsage:
        """What the tenant's OTHER runs hold against its limits, in one round trip.

        Call it after locking the tenant row: each subquery then reads everything committed
        before the lock was granted (READ COMMITTED takes the statement's snapshot after it).
        """
        others = (Run.tenant_id == tenant_id, Run.id != excluding)
        active = (
            select(func.count()).select_from(Run)
            .where(*others, Run.status.in_([s.value for s in ACTIVE_STATUSES]), Run.finished_at.is_(None))
            .scalar_subquery()
        )
        in_window = (
            select(func.coalesce(func.sum(Run.reserved_tokens), 0))
            .where(*others, Run.created_at > func.now() - window)
            .scalar_subquery()
        )
        row = (await self._session.execute(select(active, in_window))).one()
        return LimitUsage(active_runs=int(row[0]), tokens_in_window=int(row[1]))

    async def admitted_in_window(self, tenant_id: uuid.UUID, window: dt.timedelta,
                                 excluding: uuid.UUID) -> list[WindowEntry]:
        """(age, reserved tokens) of the tenant's other runs created within `window`, oldest first."""
        age = type_coerce(func.now() - Run.created_at, Interval)
        rows = await self._session.execute(
            select(age, Run.reserved_tokens)
            .where(Run.tenant_id == tenant_id, Run.created_at > func.now() - window, Run.id != excluding)
            .order_by(Run.created_at)
        )
        return [WindowEntry(age=row[0], tokens=int(row[1])) for row in rows]

    async def in_flight_totals(self, tenant_id: uuid.UUID | None) -> InFlightTotals:
        """Reservations of runs not yet terminal: one tenant's, or every tenant's (None)."""
        query = select(
            func.count(),
            func.coalesce(func.sum(Run.reserved_tokens), 0),
            func.coalesce(func.sum(Run.reserved_cost_micros), 0),
        ).where(Run.status.in_([s.value for s in ACTIVE_STATUSES]), Run.finished_at.is_(None))
        if tenant_id is not None:
            query = query.where(Run.tenant_id == tenant_id)
        row = (await self._session.execute(query)).one()
        return InFlightTotals(runs=int(row[0]), reserved_tokens=int(row[1]), reserved_cost_micros=int(row[2]))

    async def kv_tokens_held(self, tenant_id: uuid.UUID) -> int:
        """KV tokens (prompt + output cap) the tenant's claimed, unfinished runs hold: what its
        GPU-memory budget is checked against at dispatch (sluice/traffic/gpu_budget.py)."""
        total = await self._session.scalar(
            select(func.coalesce(func.sum(Run.input_tokens + Run.max_output_tokens), 0))
            .where(Run.tenant_id == tenant_id,
                   Run.status.in_([RunStatus.QUEUED.value, RunStatus.RUNNING.value]),
                   Run.finished_at.is_(None)))
        return int(total or 0)


class BudgetRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def try_reserve(self, tenant_id: uuid.UUID, tokens: int, cost_micros: int) -> bool:
        """Atomically add a reservation to the current period if it fits both budgets.

        One conditional UPDATE: concurrent reservations on the row serialize on its row lock and
        each re-checks the condition against the latest committed amounts, so no interleaving can
        overshoot (and the table's CHECK constraints would refuse it anyway).
        """
        result = await self._session.execute(
            update(Budget)
            .where(
                Budget.tenant_id == tenant_id,
                Budget.period_start == current_period_start(),
                Budget.reserved_tokens + Budget.used_tokens + tokens <= Budget.token_budget,
                Budget.reserved_cost_micros + Budget.used_cost_micros + cost_micros
                <= Budget.cost_budget_micros,
            )
            .values(
                reserved_tokens=Budget.reserved_tokens + tokens,
                reserved_cost_micros=Budget.reserved_cost_micros + cost_micros,
            )
            .execution_options(synchronize_session=False)
        )
        return bool(result.rowcount == 1)  # type: ignore[attr-defined]

    async def current(self, tenant_id: uuid.UUID) -> BudgetState | None:
        budget = await self._session.scalar(
            select(Budget).where(Budget.tenant_id == tenant_id, Budget.period_start == current_period_start())
        )
        return None if budget is None else BudgetState.of(budget)

    async def open_current_period(self, tenant_id: uuid.UUID) -> bool:
        """Start the current period with the limits of the tenant's latest earlier period.

        Budgets roll over monthly: nothing carries over except the limits. Returns False when the
        tenant never had a budget (or another transaction opened the period first).
        """
        latest = (
            select(
                Budget.tenant_id,
                current_period_start().label("period_start"),
                Budget.token_budget,
                Budget.cost_budget_micros,
            )
            .where(Budget.tenant_id == tenant_id, Budget.period_start < current_period_start())
            .order_by(Budget.period_start.desc())
            .limit(1)
        )
        columns = ["tenant_id", "period_start", "token_budget", "cost_budget_micros"]
        opened: Result[Any] = await self._session.execute(
            pg_insert(Budget)
            .from_select(columns, latest)
            .on_conflict_do_nothing(index_elements=[Budget.tenant_id, Budget.period_start])
            .returning(literal_column("1"))
        )
        return opened.first() is not None

    async def settle(self, tenant_id: uuid.UUID, run_created_at: dt.datetime, *, released_tokens: int,
                     released_cost_micros: int, used_tokens: int, used_cost_micros: int) -> None:
        """Replace a run's reservation with what it consumed, in the period it was admitted in."""
        result = await self._session.execute(
            update(Budget)
            .where(Budget.tenant_id == tenant_id, Budget.period_start == period_start_of(run_created_at))
            .values(
                reserved_tokens=Budget.reserved_tokens - released_tokens,
                reserved_cost_micros=Budget.reserved_cost_micros - released_cost_micros,
                used_tokens=Budget.used_tokens + used_tokens,
                used_cost_micros=Budget.used_cost_micros + used_cost_micros,
            )
            .execution_options(synchronize_session=False)
        )
        assert result.rowcount == 1, (  # type: ignore[attr-defined]
            f"no budget row for tenant {tenant_id} in the period of {run_created_at}: a reservation was lost"
        )


@dataclass(frozen=True, slots=True)
class Caller:
    """Who presented a valid key: the key, its scope, and (for a tenant key) its tenant."""

    key_id: uuid.UUID
    key_prefix: str
    scope: KeyScope
    tenant: TenantInfo | None        # None for finance and admin keys


LAST_USED_RESOLUTION = dt.timedelta(seconds=60)  # last_used_at is refreshed at most this often


class ApiKeyRepository:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def caller(self, key: str) -> Caller | None:
        """The caller a presented key stands for, or None: unknown, revoked or expired.

        Read from the ledger on every call (no per-process cache), so a revoke or an expiry is
        in force from the next request on every gateway. One indexed read finds the candidates
        (an unsalted key by its hash, a salted one by its public prefix) and the hash is checked
        here; last_used_at is written at most once a minute per key, and never waits on a
        concurrent writer of the same row (SKIP LOCKED).
        """
        prefix = salted_prefix(key)
        found = (ApiKey.key_hash == unsalted_hash(key)) & ApiKey.key_salt.is_(None)
        if prefix is not None:
            found = found | ((ApiKey.key_prefix == prefix) & ApiKey.key_salt.is_not(None))
        stale = or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < func.now() - LAST_USED_RESOLUTION)
        rows = (
            await self._session.execute(
                select(ApiKey.id.label("key_id"), ApiKey.key_prefix, ApiKey.key_hash, ApiKey.key_salt,
                       ApiKey.scope, stale.label("key_stale"), Tenant.id.label("tenant_id"),
                       Tenant.name.label("tenant_name"), Tenant.allowed_tiers, Tenant.max_concurrent_runs,
                       Tenant.tokens_per_minute, Tenant.shared_cache_scope, Tenant.suspended_at,
                       Tenant.batch_allowed, Tenant.kv_token_budget)
                .outerjoin(Tenant, ApiKey.tenant_id == Tenant.id)
                .where(found, ApiKey.revoked_at.is_(None),
                       or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > func.now()))
            )
        ).all()
        row = next((row for row in rows if matches(key, row.key_hash, row.key_salt)), None)
        if row is None:
            return None
        if row.key_stale:
            await self._session.execute(touch_key(row.key_id))
        return caller_of(row)


def caller_of(row: Any) -> Caller:
    """A Caller from a row naming the key (key_id, key_prefix, scope) and its tenant's columns
    (tenant_id, tenant_name, allowed_tiers, ..., suspended_at; NULL for finance and admin keys)."""
    tenant = None if row.tenant_id is None else TenantInfo(
        id=row.tenant_id,
        name=row.tenant_name,
        allowed_tiers=tuple(row.allowed_tiers),
        max_concurrent_runs=row.max_concurrent_runs,
        tokens_per_minute=row.tokens_per_minute,
        shared_cache_scope=row.shared_cache_scope,
        suspended=row.suspended_at is not None,
        api_key_id=row.key_id,
        batch_allowed=bool(getattr(row, "batch_allowed", False)),
        kv_token_budget=getattr(row, "kv_token_budget", None),
    )
    return Caller(key_id=row.key_id, key_prefix=row.key_prefix, scope=KeyScope(row.scope), tenant=tenant)


def touch_key(key_id: uuid.UUID) -> Any:
    """The UPDATE that records a key's use; skips a row another transaction holds (never waits)."""
    unlocked = select(ApiKey.id).where(ApiKey.id == key_id).with_for_update(skip_locked=True)
    return (update(ApiKey).where(ApiKey.id.in_(unlocked)).values(last_used_at=func.now())
            .execution_options(synchronize_session=False))
