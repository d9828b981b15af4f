"""The Admin API (protos/sluice/v1/admin.proto): operators run Sluice without a SQL shell.

Every RPC is one transaction, opened in `AdminService._admin`:

    BEGIN
      API key → caller                     missing/unknown/revoked/expired → UNAUTHENTICATED
      caller's scope is admin              tenant or finance key → PERMISSION_DENIED
      read what changes FOR UPDATE (before), change it, read it back (after)
      INSERT admin_audit (actor, action, target, before, after)
    COMMIT

so a change never commits without its audit row. Live by construction: admission, settlement and
authentication read tenants, keys, budgets and models from the ledger on every request, so a
change is in force from the next request on every gateway; replicas reach routing processes
through services/routing/registry_sync.py.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.ledger import audit
from sluice.ledger.admin import (
    BudgetAdmin,
    KeyAdmin,
    KeyRecord,
    Limits,
    ModelAdmin,
    ModelRecord,
    NewModel,
    Prices,
    TenantAdmin,
    TenantRecord,
)
from sluice.ledger.audit import Actor, AuditRecord
from sluice.ledger.canaries import CanaryRecord, CanaryRepository
from sluice.ledger.models import KeyScope
from sluice.ledger.replicas import ReplicaRecord, ReplicaRepository
from sluice.ledger.repositories import BudgetState, current_period_start
from sluice.services import admin_traffic as traffic
from sluice.services.auth import Metadata, identify, require_scope
from sluice.services.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.models import load_tokenizer
from sluice.router.registry import RegistryError, ReplicaSpec
from sluice.traffic.canary import Guardrails
from sluice.traffic.fallback import FallbackRule

# --- messages (shared by code and tests) ------------------------------------------------------

NAME_MISSING = "{what} is empty: name the {what} to act on"
TENANT_EXISTS = "tenant {name!r} already exists: pick another name, or change it with SetLimits/SetBudget"
UNKNOWN_TENANT = "unknown tenant {name!r}: ListTenants shows the tenants"
UNKNOWN_KEY = "unknown API key {ref!r}: give a key id or prefix from ListApiKeys"
UNKNOWN_SCOPE = "unknown key scope {scope!r}: use tenant, finance or admin"
KEY_NEEDS_TENANT = "a key of scope 'tenant' needs a tenant: name it"
KEY_HAS_NO_TENANT = "a key of scope {scope!r} acts on every tenant: leave the tenant empty"
KEY_REVOKED = "API key {prefix} is revoked: create a new key instead of rotating it"
NEGATIVE_VALUE = "{field} must be 0 or more (got {value})"
BAD_PERIOD = "period {value!r} is not a month: use YYYY-MM"
MODEL_EXISTS = "model version {version!r} already exists: register a new version name"
UNKNOWN_VERSION = "unknown model version {version!r}: ListModels shows the versions"
VERSION_RETIRED = "model version {version!r} is retired: register a new version"
ALIAS_HELD = "alias {alias!r} is held by {holder!r}: register without it, then MoveAlias"
RETIRE_ALIASED = "model version {version!r} holds alias {alias!r}: move the alias to another version first"
BAD_TOKENIZER = "tokenizer {path!r} cannot be loaded ({error}): give a tokenizer.json path"
CONTEXT_NOT_POSITIVE = "context_limit must be greater than 0 (got {value})"
REPLICA_UNKNOWN = "unknown replica {name!r}: ListReplicas shows the registry"

DEFAULT_ROTATION_OVERLAP = dt.timedelta(hours=1)
DEFAULT_AUDIT_LIMIT = 100
_PERIOD = re.compile(r"^(\d{4})-(\d{2})$")


@dataclass(frozen=True, slots=True)
class TenantView:
    tenant: TenantRecord
    budget: BudgetState | None  # the current period's


@dataclass(frozen=True, slots=True)
class CreatedKey:
    key: KeyRecord
    secret: str  # shown once
    replaced: KeyRecord | None = None


def parse_period(value: str) -> dt.date | None:
    """YYYY-MM → its first day; "" → None (the current period)."""
    if not value:
        return None
    match = _PERIOD.match(value)
    if match is None or not 1 <= int(match.group(2)) <= 12:
        raise InvalidArgument(BAD_PERIOD.format(value=value))
    return dt.date(int(match.group(1)), int(match.group(2)), 1)


def _not_negative(**values: int) -> None:
    for field, value in values.items():
        if value < 0:
            raise InvalidArgument(NEGATIVE_VALUE.format(field=field, value=value))


def _named(what: str, value: str) -> str:
    if not value:
        raise InvalidArgument(NAME_MISSING.format(what=what))
    return value


class AdminService:
    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], bootstrap_replicas: Sequence[ReplicaSpec] = ()
    ) -> None:
        self._sessionmaker = sessionmaker
        self._bootstrap = {spec.name: spec for spec in bootstrap_replicas}

    @contextlib.asynccontextmanager
    async def _admin(self, metadata: Metadata) -> AsyncIterator[tuple[AsyncSession, Actor]]:
        """One transaction for an admin-scoped caller; raising inside rolls everything back."""
        async with self._sessionmaker() as session, session.begin():
            caller = await identify(session, metadata)
            require_scope(caller, "the Admin API", KeyScope.ADMIN)
            yield session, Actor(caller.key_id, caller.key_prefix)

    # --- tenants ------------------------------------------------------------------------------

    async def create_tenant(
        self,
        metadata: Metadata,
        name: str,
        allowed_tiers: tuple[str, ...],
        limits: Limits,
        token_budget: int,
        cost_budget_micros: int,
    ) -> TenantView:
        async with self._admin(metadata) as (session, actor):
            _named("tenant", name)
            _not_negative(
                max_concurrent_runs=limits.max_concurrent_runs or 0,
                tokens_per_minute=limits.tokens_per_minute or 0,
                token_budget=token_budget,
                cost_budget_micros=cost_budget_micros,
            )
            tenant = await TenantAdmin(session).create(name, allowed_tiers or ("standard",), limits)
            if tenant is None:
                raise AlreadyExists(TENANT_EXISTS.format(name=name))
            await audit.record(session, actor, "tenant.create", name, None, tenant)
            budget = None
            if token_budget or cost_budget_micros:
                budget = await self._set_budget(
                    session, actor, tenant, None, token_budget, cost_budget_micros
                )
        return TenantView(tenant, budget)

    async def list_tenants(self, metadata: Metadata) -> list[TenantRecord]:
        async with self._admin(metadata) as (session, _):
            return await TenantAdmin(session).all()

    async def get_tenant(self, metadata: Metadata, name: str) -> TenantView:
        async with self._admin(metadata) as (session, _):
            tenant = await _tenant(session, name)
            budget = await BudgetAdmin(session).get(tenant.id, await _current_period(session))
        return TenantView(tenant, budget)

    async def suspend_tenant(self, metadata: Metadata, name: str, resume: bool) -> TenantRecord:
        async with self._admin(metadata) as (session, actor):
            changed = await TenantAdmin(session).set_suspended(_named("tenant", name), not resume)
            if changed is None:
                raise NotFound(UNKNOWN_TENANT.format(name=name))
            await audit.record(
                session, actor, "tenant.resume" if resume else "tenant.suspend", name, *changed
            )
        return changed[1]

    async def set_limits(self, metadata: Metadata, name: str, limits: Limits) -> TenantRecord:
        async with self._admin(metadata) as (session, actor):
            _not_negative(
                max_concurrent_runs=limits.max_concurrent_runs or 0,
                tokens_per_minute=limits.tokens_per_minute or 0,
                kv_token_budget=limits.kv_token_budget or 0,
            )
            changed = await TenantAdmin(session).set_limits(_named("tenant", name), limits)
            if changed is None:
                raise NotFound(UNKNOWN_TENANT.format(name=name))
            await audit.record(session, actor, "tenant.set_limits", name, *changed)
        return changed[1]

    async def set_budget(
        self, metadata: Metadata, name: str, period: str, token_budget: int, cost_budget_micros: int
    ) -> BudgetState:
        async with self._admin(metadata) as (session, actor):
            _not_negative(token_budget=token_budget, cost_budget_micros=cost_budget_micros)
            period_start = parse_period(period)
            tenant = await _tenant(session, name)
            return await self._set_budget(
                session, actor, tenant, period_start, token_budget, cost_budget_micros
            )

    @staticmethod
    async def _set_budget(
        session: AsyncSession,
        actor: Actor,
        tenant: TenantRecord,
        period_start: dt.date | None,
        token_budget: int,
        cost_budget_micros: int,
    ) -> BudgetState:
        start = period_start or await _current_period(session)
        before, after = await BudgetAdmin(session).set(tenant.id, start, token_budget, cost_budget_micros)
        await audit.record(session, actor, "budget.set", f"{tenant.name} {start:%Y-%m}", before, after)
        return after

    # --- keys -----------------------------------------------------------------------------------

    async def create_key(
        self, metadata: Metadata, tenant: str, scope: str, label: str, expires_in_s: int
    ) -> CreatedKey:
        async with self._admin(metadata) as (session, actor):
            key_scope = _scope(scope)
            _not_negative(expires_in_s=expires_in_s)
            if key_scope is KeyScope.TENANT and not tenant:
                raise InvalidArgument(KEY_NEEDS_TENANT)
            if key_scope is not KeyScope.TENANT and tenant:
                raise InvalidArgument(KEY_HAS_NO_TENANT.format(scope=key_scope.value))
            tenant_id = (await _tenant(session, tenant)).id if tenant else None
            expires_at = None
            if expires_in_s:
                expires_at = await _now(session) + dt.timedelta(seconds=expires_in_s)
            key, secret = await KeyAdmin(session).create(tenant_id, key_scope, label, expires_at)
            await audit.record(session, actor, "api_key.create", key.prefix, None, key)
        return CreatedKey(key, secret)

    async def list_keys(self, metadata: Metadata, tenant: str) -> list[KeyRecord]:
        async with self._admin(metadata) as (session, _):
            tenant_id = (await _tenant(session, tenant)).id if tenant else None
            return await KeyAdmin(session).list(tenant_id)

    async def rotate_key(self, metadata: Metadata, ref: str, overlap_s: int) -> CreatedKey:
        """A new key for the same tenant, scope and label; the old one keeps working for the
        overlap (default an hour), so its holders can switch without a refused request."""
        async with self._admin(metadata) as (session, actor):
            _not_negative(overlap_s=overlap_s)
            overlap = dt.timedelta(seconds=overlap_s) if overlap_s else DEFAULT_ROTATION_OVERLAP
            keys = KeyAdmin(session)
            old = await _key(keys, ref)
            if old.revoked_at is not None:
                raise FailedPrecondition(KEY_REVOKED.format(prefix=old.prefix))
            new, secret = await keys.create(old.tenant_id, old.scope, old.label, None, rotated_from=old.id)
            replaced = await keys.expire_within(old, overlap)
            await audit.record(
                session, actor, "api_key.rotate", old.prefix, {"old": old}, {"old": replaced, "new": new}
            )
        return CreatedKey(new, secret, replaced)

    async def revoke_key(self, metadata: Metadata, ref: str) -> KeyRecord:
        async with self._admin(metadata) as (session, actor):
            keys = KeyAdmin(session)
            before = await _key(keys, ref)
            after = await keys.revoke(before)
            await audit.record(session, actor, "api_key.revoke", before.prefix, before, after)
        return after

    # --- models ---------------------------------------------------------------------------------

    async def register_model(self, metadata: Metadata, new: NewModel) -> ModelRecord:
        async with self._admin(metadata) as (session, actor):
            _check_model(new)
            models = ModelAdmin(session)
            created = await models.register(new)
            if created is None:
                raise AlreadyExists(MODEL_EXISTS.format(version=new.version))
            if new.alias:
                holder = await models.holder_of(new.alias)
                if holder is not None:
                    raise AlreadyExists(ALIAS_HELD.format(alias=new.alias, holder=holder.version))
                await models.move_alias(new.alias, new.version)
                created = await _model(models, new.version)
            await audit.record(session, actor, "model.register", new.version, None, created)
        return created

    async def list_models(self, metadata: Metadata) -> list[ModelRecord]:
        async with self._admin(metadata) as (session, _):
            return await ModelAdmin(session).all()

    async def set_price_card(self, metadata: Metadata, version: str, prices: Prices) -> ModelRecord:
        async with self._admin(metadata) as (session, actor):
            _check_prices(prices)
            models = ModelAdmin(session)
            await _model(models, version)
            before, after = await models.set_prices(version, prices)
            await audit.record(session, actor, "model.set_price_card", version, before, after)
        return after

    async def move_alias(self, metadata: Metadata, alias: str, version: str) -> ModelRecord:
        async with self._admin(metadata) as (session, actor):
            _named("alias", alias)
            models = ModelAdmin(session)
            holder = await models.holder_of(alias)
            await models.lock(version, *([holder.version] if holder else []))
            target = await _model(models, version)
            if target.retired_at is not None:
                raise FailedPrecondition(VERSION_RETIRED.format(version=version))
            await models.move_alias(alias, version)
            after = await _model(models, version)
            await audit.record(
                session,
                actor,
                "model.move_alias",
                alias,
                {"alias": alias, "version": holder.version if holder else None},
                {"alias": alias, "version": version},
            )
            # A canary compares its candidate with the baseline it started on: moved by hand, it ends.
            await traffic.end_canary_on_move(session, actor, alias, version)
        return after

    async def retire_model(self, metadata: Metadata, version: str) -> ModelRecord:
        async with self._admin(metadata) as (session, actor):
            models = ModelAdmin(session)
            await models.lock(version)
            before = await _model(models, version)
            if before.alias is not None:
                raise FailedPrecondition(RETIRE_ALIASED.format(version=version, alias=before.alias))
            await models.retire(version)
            after = await _model(models, version)
            await audit.record(session, actor, "model.retire", version, before, after)
        return after

    # --- replicas -------------------------------------------------------------------------------

    async def upsert_replica(self, metadata: Metadata, table: Mapping[str, Any]) -> ReplicaRecord:
        """Add or replace a replica from a config-style table (router/registry.py's keys)."""
        async with self._admin(metadata) as (session, actor):
            spec = spec_from_table(table)
            replicas = ReplicaRepository(session)
            before = await self._replica(replicas, spec.name)
            after = await replicas.put(spec)
            await audit.record(session, actor, "replica.upsert", spec.name, before, after)
        return after

    async def remove_replica(self, metadata: Metadata, name: str) -> bool:
        """Writes a tombstone (a configured replica stays removed); False if there was none."""
        async with self._admin(metadata) as (session, actor):
            _named("replica", name)
            replicas = ReplicaRepository(session)
            before = await self._replica(replicas, name)
            if before is None:
                return False
            after = await replicas.put(before, removed=True)
            await audit.record(session, actor, "replica.remove", name, before, after)
        return True

    async def list_replicas(self, metadata: Metadata) -> list[ReplicaRecord]:
        """The registry as routing processes see it: config overlaid with the durable rows."""
        async with self._admin(metadata) as (session, _):
            rows = {row.name: row for row in await ReplicaRepository(session).all()}
        merged = {name: ReplicaRecord.configured(spec) for name, spec in self._bootstrap.items()} | rows
        return [merged[name] for name in sorted(merged) if not merged[name].removed]

    async def _replica(self, replicas: ReplicaRepository, name: str) -> ReplicaRecord | None:
        """The live replica of that name (a durable row, else the configured one), or None."""
        row = await replicas.get(name)
        if row is not None:
            return None if row.removed else row
        spec = self._bootstrap.get(name)
        return None if spec is None else ReplicaRecord.configured(spec)

    # --- audit ----------------------------------------------------------------------------------

    # --- traffic policy (services/admin_traffic.py) ------------------------------------------

    async def set_fallbacks(self, metadata: Metadata, tenant: str,
                            rules: Sequence[FallbackRule]) -> list[FallbackRule]:
        async with self._admin(metadata) as (session, actor):
            return await traffic.set_fallbacks(session, actor, await _tenant(session, tenant), rules)

    async def get_fallbacks(self, metadata: Metadata, tenant: str) -> list[FallbackRule]:
        async with self._admin(metadata) as (session, _):
            return await traffic.get_fallbacks(session, await _tenant(session, tenant))

    async def start_canary(self, metadata: Metadata, alias: str, candidate: str, share_bp: int,
                           limits: Guardrails) -> CanaryRecord:
        async with self._admin(metadata) as (session, actor):
            return await traffic.start_canary(session, actor, _named("alias", alias), candidate, share_bp,
                                              limits)

    async def list_canaries(self, metadata: Metadata) -> list[CanaryRecord]:
        async with self._admin(metadata) as (session, _):
            return await CanaryRepository(session).all()

    async def set_canary_share(self, metadata: Metadata, alias: str, share_bp: int) -> CanaryRecord:
        async with self._admin(metadata) as (session, actor):
            return await traffic.set_canary_share(session, actor, alias, share_bp)

    async def stop_canary(self, metadata: Metadata, alias: str, reason: str) -> CanaryRecord:
        async with self._admin(metadata) as (session, actor):
            return await traffic.stop_canary(session, actor, alias, reason)

    async def promote_canary(self, metadata: Metadata, alias: str) -> CanaryRecord:
        async with self._admin(metadata) as (session, actor):
            return await traffic.promote_canary(session, actor, alias)

    async def audit_log(self, metadata: Metadata, limit: int, action: str) -> list[AuditRecord]:
        async with self._admin(metadata) as (session, _):
            return await audit.recent(session, limit or DEFAULT_AUDIT_LIMIT, action or None)


def _scope(value: str) -> KeyScope:
    try:
        return KeyScope(value or KeyScope.TENANT.value)
    except ValueError:
        raise InvalidArgument(UNKNOWN_SCOPE.format(scope=value)) from None


def _check_model(new: NewModel) -> None:
    _named("model version", new.version)
    if new.context_limit <= 0:
        raise InvalidArgument(CONTEXT_NOT_POSITIVE.format(value=new.context_limit))
    _check_prices(new.prices)
    try:
        load_tokenizer(new.tokenizer)
    except Exception as exc:  # the tokenizers library raises its own Exception types
        raise InvalidArgument(BAD_TOKENIZER.format(path=new.tokenizer, error=exc)) from None


def _check_prices(prices: Prices) -> None:
    _not_negative(
        price_input_per_m_micros=prices.input_per_m_micros,
        price_cached_input_per_m_micros=prices.cached_input_per_m_micros,
        price_output_per_m_micros=prices.output_per_m_micros,
    )


async def _tenant(session: AsyncSession, name: str) -> TenantRecord:
    tenant = await TenantAdmin(session).by_name(_named("tenant", name))
    if tenant is None:
        raise NotFound(UNKNOWN_TENANT.format(name=name))
    return tenant


async def _key(keys: KeyAdmin, ref: str) -> KeyRecord:
    key = await keys.by_ref(_named("key", ref), lock=True)
    if key is None:
        raise NotFound(UNKNOWN_KEY.format(ref=ref))
    return key


async def _model(models: ModelAdmin, version: str) -> ModelRecord:
    model = await models.get(_named("model version", version))
    if model is None:
        raise NotFound(UNKNOWN_VERSION.format(version=version))
    return model


async def _current_period(session: AsyncSession) -> dt.date:
    start = await session.scalar(select(current_period_start()))
    assert start is not None
    return start


async def _now(session: AsyncSession) -> dt.datetime:
    now = await session.scalar(select(func.now()))
    assert now is not None
    return now


def spec_from_table(table: Mapping[str, Any]) -> ReplicaSpec:
    try:
        return ReplicaSpec.from_table(table)
    except RegistryError as exc:
        raise InvalidArgument(str(exc)) from exc


__all__ = ["AdminService", "CreatedKey", "TenantView", "parse_period", "spec_from_table"]
