"""What the Admin API changes in the ledger: tenants, keys, budgets, models and price cards.

Repositories in the house style: made from the caller's session, never committing, handing out
frozen records. Each change returns (before, after) records so the service can audit it in the
same transaction; a row that is changed is read FOR UPDATE first, so `before` is the state the
change really replaced, not one a concurrent admin overwrote in between.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass

from sluice.ledger.keys import generate_key
from sluice.ledger.models import ApiKey, Budget, KeyScope, Model, PriceCard, Tenant
from sluice.ledger.repositories import BudgetState
from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession


@dataclass(frozen=True, slots=True)
class TenantRecord:
    id: uuid.UUID
    name: str
    allowed_tiers: tuple[str, ...]
    max_concurrent_runs: int | None  # None = unlimited
    tokens_per_minute: int | None
    suspended_at: dt.datetime | None
    created_at: dt.datetime
    kv_token_budget: int | None = None   # None = no cap
    batch_allowed: bool = False

    @classmethod
    def of(cls, row: Tenant) -> TenantRecord:
        return cls(
            id=row.id,
            name=row.name,
            allowed_tiers=tuple(row.allowed_tiers),
            max_concurrent_runs=row.max_concurrent_runs,
            tokens_per_minute=row.tokens_per_minute,
            suspended_at=row.suspended_at,
            created_at=row.created_at,
            kv_token_budget=row.kv_token_budget,
            batch_allowed=bool(row.batch_allowed),
        )


@dataclass(frozen=True, slots=True)
class Limits:
    """A change of a tenant's limits; None leaves a field as it is, 0 means unlimited."""

    max_concurrent_runs: int | None = None
    tokens_per_minute: int | None = None
    allowed_tiers: tuple[str, ...] | None = None
    kv_token_budget: int | None = None   # 0 = no cap
    batch_allowed: bool | None = None


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A key as listings show it: never its secret or hash."""

    id: uuid.UUID
    prefix: str
    tenant_id: uuid.UUID | None
    tenant: str | None
    scope: KeyScope
    label: str
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    rotated_from: uuid.UUID | None


@dataclass(frozen=True, slots=True)
class Prices:
    input_per_m_micros: int
    cached_input_per_m_micros: int
    output_per_m_micros: int


@dataclass(frozen=True, slots=True)
class ModelRecord:
    version: str
    alias: str | None
    tokenizer: str
    context_limit: int
    worker_pool: str
    quality_tier: str
    end_id: int
    prices: Prices
    price_card_id: int | None
    retired_at: dt.datetime | None

    @classmethod
    def of(cls, row: Model) -> ModelRecord:
        return cls(
            version=row.version,
            alias=row.alias,
            tokenizer=row.tokenizer,
            context_limit=row.context_limit,
            worker_pool=row.worker_pool,
            quality_tier=row.quality_tier,
            end_id=row.end_id,
            prices=Prices(
                row.price_input_per_m_micros,
                row.price_cached_input_per_m_micros,
                row.price_output_per_m_micros,
            ),
            price_card_id=row.price_card_id,
            retired_at=row.retired_at,
        )


@dataclass(frozen=True, slots=True)
class NewModel:
    version: str
    tokenizer: str
    context_limit: int
    worker_pool: str
    quality_tier: str
    end_id: int
    prices: Prices
    alias: str | None = None
    chat_template: str | None = None  # Jinja text (models.chat_template); None = completions only


class TenantAdmin:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def create(self, name: str, allowed_tiers: tuple[str, ...], limits: Limits) -> TenantRecord | None:
        """The new tenant, or None when the name is taken."""
        tenant_id = await self._session.scalar(
            pg_insert(Tenant)
            .values(
                id=uuid.uuid4(),
                name=name,
                allowed_tiers=list(allowed_tiers),
                max_concurrent_runs=limits.max_concurrent_runs or None,
                tokens_per_minute=limits.tokens_per_minute or None,
            )
            .on_conflict_do_nothing(index_elements=[Tenant.name])
            .returning(Tenant.id)
        )
        if tenant_id is None:
            return None
        row = await self._session.get(Tenant, tenant_id)
        assert row is not None
        return TenantRecord.of(row)

    async def all(self) -> list[TenantRecord]:
        rows = await self._session.scalars(select(Tenant).order_by(Tenant.name))
        return [TenantRecord.of(row) for row in rows]

    async def by_name(self, name: str) -> TenantRecord | None:
        row = await self._session.scalar(select(Tenant).where(Tenant.name == name))
        return None if row is None else TenantRecord.of(row)

    async def set_suspended(self, name: str, suspended: bool) -> tuple[TenantRecord, TenantRecord] | None:
        row = await self._locked(name)
        if row is None:
            return None
        before = TenantRecord.of(row)
        if suspended != (row.suspended_at is not None):
            row.suspended_at = await self._now() if suspended else None
            await self._session.flush()
        return before, TenantRecord.of(row)

    async def set_limits(self, name: str, limits: Limits) -> tuple[TenantRecord, TenantRecord] | None:
        row = await self._locked(name)
        if row is None:
            return None
        before = TenantRecord.of(row)
        if limits.max_concurrent_runs is not None:
            row.max_concurrent_runs = limits.max_concurrent_runs or None
        if limits.tokens_per_minute is not None:
            row.tokens_per_minute = limits.tokens_per_minute or None
        if limits.allowed_tiers is not None:
            row.allowed_tiers = list(limits.allowed_tiers)
        if limits.kv_token_budget is not None:
            row.kv_token_budget = limits.kv_token_budget or None
        if limits.batch_allowed is not None:
            row.batch_allowed = limits.batch_allowed
        await self._session.flush()
        return before, TenantRecord.of(row)

    async def _locked(self, name: str) -> Tenant | None:
        return await self._session.scalar(select(Tenant).where(Tenant.name == name).with_for_update())

    async def _now(self) -> dt.datetime:
        now = await self._session.scalar(select(func.now()))
        assert now is not None
        return now


class BudgetAdmin:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def get(self, tenant_id: uuid.UUID, period_start: dt.date) -> BudgetState | None:
        row = await self._session.scalar(
            select(Budget).where(Budget.tenant_id == tenant_id, Budget.period_start == period_start)
        )
        return None if row is None else BudgetState.of(row)

    async def set(
        self, tenant_id: uuid.UUID, period_start: dt.date, token_budget: int, cost_budget_micros: int
    ) -> tuple[BudgetState | None, BudgetState]:
        """Set a period's budget, creating the row if needed; reservations and usage are untouched.

        Lowering it below reserved + used is allowed (the reservation trigger checks only a
        growing reservation): the next Submit is refused, runs in flight settle as usual.
        """
        existing = await self._session.scalar(
            select(Budget)
            .where(Budget.tenant_id == tenant_id, Budget.period_start == period_start)
            .with_for_update()
        )
        before = None if existing is None else BudgetState.of(existing)
        statement = pg_insert(Budget).values(
            tenant_id=tenant_id,
            period_start=period_start,
            token_budget=token_budget,
            cost_budget_micros=cost_budget_micros,
        )
        row = await self._session.scalar(
            statement.on_conflict_do_update(
                index_elements=[Budget.tenant_id, Budget.period_start],
                set_={"token_budget": token_budget, "cost_budget_micros": cost_budget_micros},
            )
            .returning(Budget)
            .execution_options(populate_existing=True)
        )
        assert row is not None
        return before, BudgetState.of(row)


class KeyAdmin:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def create(
        self,
        tenant_id: uuid.UUID | None,
        scope: KeyScope,
        label: str,
        expires_at: dt.datetime | None,
        rotated_from: uuid.UUID | None = None,
    ) -> tuple[KeyRecord, str]:
        """A new key and its secret (the only time the secret exists outside its holder)."""
        new = generate_key()
        key_id = uuid.uuid4()
        self._session.add(
            ApiKey(
                id=key_id,
                tenant_id=tenant_id,
                key_hash=new.key_hash,
                key_prefix=new.prefix,
                key_salt=new.salt,
                scope=scope.value,
                label=label,
                expires_at=expires_at,
                rotated_from=rotated_from,
            )
        )
        await self._session.flush()
        record = await self.by_ref(str(key_id))
        assert record is not None
        return record, new.secret

    async def list(self, tenant_id: uuid.UUID | None) -> list[KeyRecord]:
        query = self._select().order_by(ApiKey.created_at, ApiKey.key_prefix)
        if tenant_id is not None:
            query = query.where(ApiKey.tenant_id == tenant_id)
        return [_key_record(row) for row in (await self._session.execute(query)).all()]

    async def by_ref(self, ref: str, *, lock: bool = False) -> KeyRecord | None:
        """A key by its id or its public prefix."""
        query = self._select().where(_key_ref(ref))
        if lock:
            query = query.with_for_update(of=ApiKey)
        rows = (await self._session.execute(query)).all()
        return _key_record(rows[0]) if len(rows) == 1 else None

    async def revoke(self, key: KeyRecord) -> KeyRecord:
        await self._session.execute(
            update(ApiKey)
            .where(ApiKey.id == key.id, ApiKey.revoked_at.is_(None))
            .values(revoked_at=func.now())
            .execution_options(synchronize_session=False)
        )
        return await self._reread(key)

    async def expire_within(self, key: KeyRecord, overlap: dt.timedelta) -> KeyRecord:
        """Let the key live at most `overlap` longer (an earlier expiry stays)."""
        deadline = func.now() + overlap
        await self._session.execute(
            update(ApiKey)
            .where(ApiKey.id == key.id)
            .values(expires_at=func.least(func.coalesce(ApiKey.expires_at, deadline), deadline))
            .execution_options(synchronize_session=False)
        )
        return await self._reread(key)

    async def _reread(self, key: KeyRecord) -> KeyRecord:
        record = await self.by_ref(str(key.id))
        assert record is not None
        return record

    @staticmethod
    def _select():  # type: ignore[no-untyped-def]
        return select(
            ApiKey.id,
            ApiKey.key_prefix,
            ApiKey.tenant_id,
            Tenant.name,
            ApiKey.scope,
            ApiKey.label,
            ApiKey.created_at,
            ApiKey.last_used_at,
            ApiKey.expires_at,
            ApiKey.revoked_at,
            ApiKey.rotated_from,
        ).outerjoin(Tenant, Tenant.id == ApiKey.tenant_id)


def _key_ref(ref: str):  # type: ignore[no-untyped-def]
    try:
        return ApiKey.id == uuid.UUID(ref)
    except ValueError:
        return ApiKey.key_prefix == ref


def _key_record(row) -> KeyRecord:  # type: ignore[no-untyped-def]
    return KeyRecord(
        id=row.id,
        prefix=row.key_prefix,
        tenant_id=row.tenant_id,
        tenant=row.name,
        scope=KeyScope(row.scope),
        label=row.label,
        created_at=row.created_at,
        last_used_at=row.last_used_at,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
        rotated_from=row.rotated_from,
    )


class ModelAdmin:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def register(self, new: NewModel) -> ModelRecord | None:
        """The new version with its first price card, or None when the version exists."""
        inserted = await self._session.scalar(
            pg_insert(Model)
            .values(
                version=new.version,
                alias=None,
                tokenizer=new.tokenizer,
                context_limit=new.context_limit,
                worker_pool=new.worker_pool,
                quality_tier=new.quality_tier,
                end_id=new.end_id,
                chat_template=new.chat_template,
                price_input_per_m_micros=new.prices.input_per_m_micros,
                price_cached_input_per_m_micros=new.prices.cached_input_per_m_micros,
                price_output_per_m_micros=new.prices.output_per_m_micros,
            )
            .on_conflict_do_nothing(index_elements=[Model.version])
            .returning(Model.version)
        )
        if inserted is None:
            return None
        _, after = await self.set_prices(new.version, new.prices)
        return after

    async def all(self) -> list[ModelRecord]:
        return [
            ModelRecord.of(row) for row in await self._session.scalars(select(Model).order_by(Model.version))
        ]

    async def get(self, version: str) -> ModelRecord | None:
        row = await self._session.get(Model, version, populate_existing=True)
        return None if row is None else ModelRecord.of(row)

    async def holder_of(self, alias: str) -> ModelRecord | None:
        row = await self._session.scalar(select(Model).where(Model.alias == alias))
        return None if row is None else ModelRecord.of(row)

    async def lock(self, *versions: str) -> None:
        """Row-lock the versions (in a fixed order, so two admins never deadlock)."""
        await self._session.execute(
            select(Model.version)
            .where(Model.version.in_(sorted(versions)))
            .order_by(Model.version)
            .with_for_update()
        )

    async def set_prices(self, version: str, prices: Prices) -> tuple[ModelRecord, ModelRecord]:
        """A new price card, made the model's current one. Runs admitted before keep theirs."""
        await self.lock(version)
        before = await self.get(version)
        assert before is not None, f"no model {version}"
        card_id = await self._session.scalar(
            pg_insert(PriceCard)
            .values(
                model_version=version,
                price_input_per_m_micros=prices.input_per_m_micros,
                price_cached_input_per_m_micros=prices.cached_input_per_m_micros,
                price_output_per_m_micros=prices.output_per_m_micros,
            )
            .returning(PriceCard.id)
        )
        # One UPDATE moves the copied prices and the card id together: admission reads both in
        # one row, so a run's reservation and its pinned card always agree.
        await self._session.execute(
            update(Model)
            .where(Model.version == version)
            .values(
                price_card_id=card_id,
                price_input_per_m_micros=prices.input_per_m_micros,
                price_cached_input_per_m_micros=prices.cached_input_per_m_micros,
                price_output_per_m_micros=prices.output_per_m_micros,
            )
            .execution_options(synchronize_session=False)
        )
        after = await self.get(version)
        assert after is not None
        return before, after

    async def ensure_price_card(self, version: str) -> None:
        """Give a model whose current prices are no card yet (a seeded row) a card for them."""
        model = await self.get(version)
        assert model is not None, f"no model {version}"
        card = (
            None if model.price_card_id is None else await self._session.get(PriceCard, model.price_card_id)
        )
        if (
            card is None
            or Prices(
                card.price_input_per_m_micros,
                card.price_cached_input_per_m_micros,
                card.price_output_per_m_micros,
            )
            != model.prices
        ):
            await self.set_prices(version, model.prices)

    async def move_alias(self, alias: str, version: str) -> None:
        """Point `alias` at `version` in the caller's transaction. The two UPDATEs commit together,
        so a concurrent Submit (READ COMMITTED) resolves the alias to the old or the new version."""
        await self._session.execute(
            update(Model)
            .where(Model.alias == alias, Model.version != version)
            .values(alias=None)
            .execution_options(synchronize_session=False)
        )
        await self._session.execute(
            update(Model)
            .where(Model.version == version)
            .values(alias=alias)
            .execution_options(synchronize_session=False)
        )

    async def retire(self, version: str) -> None:
        await self._session.execute(
            update(Model)
            .where(Model.version == version, Model.retired_at.is_(None))
            .values(retired_at=func.now())
            .execution_options(synchronize_session=False)
        )


__all__ = [
    "BudgetAdmin",
    "KeyAdmin",
    "KeyRecord",
    "Limits",
    "ModelAdmin",
    "ModelRecord",
    "NewModel",
    "Prices",
    "TenantAdmin",
    "TenantRecord",
]
