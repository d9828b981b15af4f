"""The run ledger's tables: the authority on tenants, models, runs, budgets and settled usage.

Enum-like columns are TEXT guarded by CHECK constraints (cheap to extend in a migration, readable
in psql); every timestamp is timestamptz; ids are UUIDs. Money is integer micro-USD throughout so
that no float ever touches a bill.

Budget invariant, enforced by the database itself so that no reservation can overshoot:

    reserved_tokens + used_tokens <= token_budget
    reserved_cost_micros + used_cost_micros <= cost_budget_micros

It is checked by a trigger (migration 0004, `budgets_reservation_fits`) whenever a reservation
GROWS, not by a CHECK: an operator may lower a budget below what runs in flight already hold
(new work is then refused, those runs are untouched), and settlement, which only shrinks
`reserved_*`, must still be able to finish them.

Admission moves a run's worst case (prompt + output cap) into `reserved_*`; settlement moves it
back out and adds what was really consumed to `used_*`, exactly once per run (usage_entries.run_id
is UNIQUE).
"""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from typing import Any

from sluice.ledger import token_ids
from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from sluice.traffic.route import RouteReason

# Stable constraint names, so alembic migrations can refer to them and downgrades can drop them.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class RunStatus(enum.StrEnum):
    """Lifecycle of a run (DESIGN.md "A run"); stored as TEXT. Terminal states are final."""

    ACCEPTED = "ACCEPTED"        # run row + budget reservation committed by admission
    QUEUED = "QUEUED"            # claimed by a routing worker; replica chosen, not yet streaming
    RUNNING = "RUNNING"          # the replica produced its first token
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    INTERRUPTED = "INTERRUPTED"  # worker or replica lost mid-stream; never regenerated
    FAILED = "FAILED"
    EXPIRED = "EXPIRED"          # deadline passed before completion


TERMINAL_STATUSES: frozenset[RunStatus] = frozenset(
    {RunStatus.COMPLETED, RunStatus.CANCELLED, RunStatus.INTERRUPTED, RunStatus.FAILED, RunStatus.EXPIRED}
)
ACTIVE_STATUSES: frozenset[RunStatus] = frozenset(RunStatus) - TERMINAL_STATUSES


def _in_list(column: str, values: list[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


_RUN_STATUS_CHECK = _in_list("status", [s.value for s in RunStatus])


# What the partial indexes of runs filter by (never `status`, see Run.__table_args__). A query names
# the predicate (`alias`: its name for runs, "r." ...) beside its status condition to use the index:
# the planner uses a partial index only for a query whose conditions imply its predicate.
def unfinished(alias: str = "") -> str:
    """Runs ACCEPTED, QUEUED or RUNNING (only settlement sets finished_at, with a terminal status)."""
    return f"{alias}finished_at IS NULL"


def unclaimed(alias: str = "") -> str:
    """Runs ACCEPTED (the claim sets queued_at as it takes one)."""
    return f"{alias}queued_at IS NULL AND {alias}finished_at IS NULL"


UNFINISHED = unfinished()
UNCLAIMED = unclaimed()
_ROUTE_REASON_CHECK = _in_list("route_reason", [r.value for r in RouteReason])
_UNPUBLISHED_TERMINAL_CHECK = "terminal_published = false AND terminal_sequence IS NOT NULL"


class TokenIds(TypeDecorator[list[int]]):
    """A prompt's token ids, list[int] in Python, stored packed (ledger/token_ids.py, migration 0014)."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> bytes | None:
        return None if value is None else token_ids.pack(value)

    def process_result_value(self, value: Any, dialect: Any) -> list[int] | None:
        return None if value is None else list(token_ids.unpack(value))


def _timestamp(*, nullable: bool = False, now: bool = False) -> Any:
    return mapped_column(
        DateTime(timezone=True), nullable=nullable, server_default=func.now() if now else None
    )


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), primary_key=True, default=uuid.uuid4, server_default=text("gen_random_uuid()")
    )
    name: Mapped[str] = mapped_column(Text, unique=True)
    # Quality tiers of models this tenant may use (admission: tier not listed → PERMISSION_DENIED).
    allowed_tiers: Mapped[list[str]] = mapped_column(
        ARRAY(Text), server_default=text("'{standard}'::text[]")
    )
    created_at: Mapped[dt.datetime] = _timestamp(now=True)
    # Limits shared by every admission instance (NULL = unlimited), checked under this row's lock:
    # runs not yet terminal, and tokens (prompt + output cap) admitted in any sliding 60 s.
    max_concurrent_runs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # Prefix-cache trust scope (DESIGN.md "Trust scopes"): NULL = this tenant alone (the default);
    # a name = the shared scope this tenant opts into for public system prompts, whose KV blocks
    # every tenant naming the same scope may reuse (services/trust_scope.py).
    shared_cache_scope: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Set by an admin: Submit is refused (PERMISSION_DENIED); runs already accepted still finish.
    suspended_at: Mapped[dt.datetime | None] = _timestamp(nullable=True)
    # May submit priority=batch runs (sluice/traffic/priority.py); otherwise PERMISSION_DENIED.
    batch_allowed: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # GPU-memory budget: cap on the KV tokens (prompt + output cap) its claimed, unfinished runs hold
    # at once across the pool, enforced at dispatch (sluice/traffic/gpu_budget.py). NULL = no cap.
    kv_token_budget: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    __table_args__ = (
        CheckConstraint(
            "(max_concurrent_runs IS NULL OR max_concurrent_runs > 0)"
            " AND (tokens_per_minute IS NULL OR tokens_per_minute > 0)",
            name="limits_positive",
        ),
        CheckConstraint("shared_cache_scope IS NULL OR length(shared_cache_scope) BETWEEN 1 AND 128",
                        name="shared_cache_scope_named"),
        CheckConstraint("kv_token_budget IS NULL OR kv_token_budget > 0", name="kv_token_budget_positive"),
    )


class KeyScope(enum.StrEnum):
    """What an API key may do (DESIGN.md "Keys and scopes"); stored as TEXT."""

    TENANT = "tenant"    # submit and read its own tenant's runs and usage
    FINANCE = "finance"  # read the usage of every tenant; nothing else
    ADMIN = "admin"      # the Admin API: tenants, keys, budgets, models, replicas


class ApiKey(Base):
    """A key's secret is never stored: `key_hash` is sha256(salt || key) with a random per-key
    `key_salt` (hex). Keys made before salting (seeded demo keys) have no salt and store
    sha256(key). A salted key is found by its `key_prefix` ("sk-" + 12 hex digits), which is
    public and names the key in listings and audit rows."""

    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), primary_key=True, default=uuid.uuid4, server_default=text("gen_random_uuid()")
    )
    # NULL only for finance and admin keys, which act on every tenant.
    tenant_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True, nullable=True
    )
    key_hash: Mapped[str] = mapped_column(Text, unique=True)
    key_prefix: Mapped[str] = mapped_column(Text, index=True)
    key_salt: Mapped[str | None] = mapped_column(Text, nullable=True)
    scope: Mapped[str] = mapped_column(Text, server_default=KeyScope.TENANT.value)
    label: Mapped[str] = mapped_column(Text, server_default="")
    created_at: Mapped[dt.datetime] = _timestamp(now=True)
    revoked_at: Mapped[dt.datetime | None] = _timestamp(nullable=True)
    # After this instant the key is refused; rotation sets it on the old key (the overlap).
    expires_at: Mapped[dt.datetime | None] = _timestamp(nullable=True)
    # Refreshed at most once a minute per key, so authentication stays a read on the hot path.
    last_used_at: Mapped[dt.datetime | None] = _timestamp(nullable=True)
    rotated_from: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True), nullable=True)

    __table_args__ = (
        CheckConstraint(_in_list("scope", [s.value for s in KeyScope]), name="scope_known"),
        CheckConstraint(f"scope <> '{KeyScope.TENANT.value}' OR tenant_id IS NOT NULL",
                        name="tenant_key_has_tenant"),
    )


class PriceCard(Base):
    """One version of a model's prices, in micro-USD per million tokens. Never updated: a price
    change is a new card. A run is pinned to the card admission priced its reservation with
    (runs.price_card_id) and settles at it, however the model's prices change meanwhile."""

    __tablename__ = "price_cards"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    model_version: Mapped[str] = mapped_column(ForeignKey("models.version"), index=True)
    price_input_per_m_micros: Mapped[int] = mapped_column(BigInteger)
    price_cached_input_per_m_micros: Mapped[int] = mapped_column(BigInteger)
    price_output_per_m_micros: Mapped[int] = mapped_column(BigInteger)
    effective_at: Mapped[dt.datetime] = _timestamp(now=True)

    __table_args__ = (
        CheckConstraint(
            "price_input_per_m_micros >= 0 AND price_cached_input_per_m_micros >= 0"
            " AND price_output_per_m_micros >= 0",
            name="prices_non_negative",
        ),
    )


class Model(Base):
    """One servable model version; `alias` ("chat") names the version callers get by default."""

    __tablename__ = "models"

    version: Mapped[str] = mapped_column(Text, primary_key=True)
    alias: Mapped[str | None] = mapped_column(Text, unique=True, nullable=True)
    tokenizer: Mapped[str] = mapped_column(Text)  # tokenizer.json path, relative to the repo root
    context_limit: Mapped[int] = mapped_column(Integer)  # prompt + output cap must fit
    worker_pool: Mapped[str] = mapped_column(Text)  # routing pool key (replicas[].pool)
    quality_tier: Mapped[str] = mapped_column(Text)
    end_id: Mapped[int] = mapped_column(Integer)  # end-of-sequence token id for the engine
    # The current price card in micro-USD per million tokens: a copy of price_cards row
    # `price_card_id`, changed together with it (one UPDATE), so admission reads both at once.
    price_input_per_m_micros: Mapped[int] = mapped_column(BigInteger)
    price_cached_input_per_m_micros: Mapped[int] = mapped_column(BigInteger)
    price_output_per_m_micros: Mapped[int] = mapped_column(BigInteger)
    # Jinja chat template (`messages`, `add_generation_prompt`) the HTTP edge renders chat requests
    # with; NULL: plain completions only. Deferred: the Submit hot path never loads it.
    chat_template: Mapped[str | None] = mapped_column(Text, nullable=True, deferred=True)
    # NULL only for rows written without the Admin API or the seed (test factories): such a
    # model's runs are priced from the columns above.
    price_card_id: Mapped[int | None] = mapped_column(
        ForeignKey("price_cards.id", use_alter=True), nullable=True
    )
    # A retired version admits no new runs; runs already pinned to it finish.
    retired_at: Mapped[dt.datetime | None] = _timestamp(nullable=True)

    __table_args__ = (
        CheckConstraint("context_limit > 0", name="context_limit_positive"),
        CheckConstraint(
            "price_input_per_m_micros >= 0 AND price_cached_input_per_m_micros >= 0"
            " AND price_output_per_m_micros >= 0",
            name="prices_non_negative",
        ),
    )


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), primary_key=True, default=uuid.uuid4, server_default=text("gen_random_uuid()")
    )
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id"))
    request_key: Mapped[str] = mapped_column(Text)  # caller's idempotency key
    payload_hash: Mapped[str] = mapped_column(Text)  # sha256 over model version, input, cap, sampling
    model_version: Mapped[str] = mapped_column(ForeignKey("models.version"))
    status: Mapped[str] = mapped_column(Text, server_default=RunStatus.ACCEPTED.value)
    prompt_token_ids: Mapped[list[int]] = mapped_column(TokenIds)   # packed: ledger/token_ids.py
    input_tokens: Mapped[int] = mapped_column(Integer)
    max_output_tokens: Mapped[int] = mapped_column(Integer)
    sampling: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    conversation_id: Mapped[str | None] = mapped_column(Text, nullable=True)
    # interactive | batch (sluice/traffic/priority.py): claim order, headroom, which backlog it joins.
    priority: Mapped[str] = mapped_column(Text, server_default="interactive")
    # The trust scope its prompt may reuse KV blocks in, fixed at admission (NULL: admitted before
    # scopes existed, treated as the tenant's own).
    cache_scope: Mapped[str | None] = mapped_column(Text, nullable=True)
    deadline_at: Mapped[dt.datetime] = _timestamp()
    # Set in the same transaction that moves ACCEPTED → QUEUED, before the replica is contacted.
    replica: Mapped[str | None] = mapped_column(Text, nullable=True)

    created_at: Mapped[dt.datetime] = _timestamp(now=True)
    queued_at: Mapped[dt.datetime | None] = _timestamp(nullable=True)
    started_at: Mapped[dt.datetime | None] = _timestamp(nullable=True)
    finished_at: Mapped[dt.datetime | None] = _timestamp(nullable=True)

    output_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    cached_input_tokens: Mapped[int] = mapped_column(Integer, server_default="0")

    # Event log bookkeeping (Kafka): what is durable there, and where the run's events start.
    last_sequence: Mapped[int] = mapped_column(BigInteger, server_default="0")
    terminal_sequence: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    terminal_published: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    event_partition: Mapped[int | None] = mapped_column(Integer, nullable=True)
    event_first_offset: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    cancel_requested_at: Mapped[dt.datetime | None] = _timestamp(nullable=True)
    lease_owner: Mapped[str | None] = mapped_column(Text, nullable=True)
    lease_expires_at: Mapped[dt.datetime | None] = _timestamp(nullable=True)
    # Fencing token: +1 whenever a process takes the run (claim, reaper); writes and events of an
    # older epoch are refused (services/routing/leases.py).
    lease_epoch: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # The W3C traceparent of the Submit span (NULL: not traced): the routing worker continues
    # that trace, so one run is one trace across the gateway and worker processes.
    traceparent: Mapped[str | None] = mapped_column(Text, nullable=True)

    # The worst case held against the tenant's budget until settlement (prompt + output cap).
    reserved_tokens: Mapped[int] = mapped_column(BigInteger)
    reserved_cost_micros: Mapped[int] = mapped_column(BigInteger)
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Who submitted it (finance groups usage by key) and the price card it was reserved at.
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True), nullable=True)
    price_card_id: Mapped[int | None] = mapped_column(ForeignKey("price_cards.id"), nullable=True)
    # The routing decision (sluice/traffic/route.py), fixed at admission: the name the caller wrote,
    # why the run went to model_version (requested | alias | canary | fallback), that version's pool
    # and tier, and for a fallback the version it would have gone to. NULL: admitted before 0008.
    requested_model: Mapped[str | None] = mapped_column(Text, nullable=True)
    route_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    worker_pool: Mapped[str | None] = mapped_column(Text, nullable=True)
    quality_tier: Mapped[str | None] = mapped_column(Text, nullable=True)
    fallback_from: Mapped[str | None] = mapped_column(Text, nullable=True)
    route_detail: Mapped[str | None] = mapped_column(Text, nullable=True)

    __table_args__ = (
        UniqueConstraint("tenant_id", "request_key"),
        CheckConstraint(f"route_reason IS NULL OR {_ROUTE_REASON_CHECK}", name="route_reason_known"),
        CheckConstraint(_RUN_STATUS_CHECK, name="status_known"),
        CheckConstraint("max_output_tokens > 0", name="max_output_tokens_positive"),
        CheckConstraint("priority IN ('interactive', 'batch')", name="priority_known"),
        # No index keys on or filters by `status`: a RUNNING mark (status, started_at, where the events
        # start) is then a HOT update, in place on its page (migration 0013). "Not finished" and "not
        # yet claimed" are said by finished_at and queued_at, which only settlement and the claim set;
        # each query keeps its status condition beside the predicate it names.
        # Admission's tokens-per-minute window (the tenant's runs of the last 60 s).
        Index("ix_runs_tenant_id_created_at", "tenant_id", "created_at"),
        # A tenant's unfinished runs: admission's concurrent-run count, the reservations and GPU
        # memory they hold; unkeyed, the reaper's expired leases and each replica's run count.
        Index("ix_runs_tenant_id_unfinished", "tenant_id", postgresql_where=text(UNFINISHED)),
        # Admission's backlog count (a model's runs of one class waiting to be claimed, counted with a
        # LIMIT): it only ever holds the runs not yet claimed, so it stays small however big runs grows.
        Index("ix_runs_model_version_priority_unclaimed", "model_version", "priority",
              postgresql_where=text(UNCLAIMED)),
        # The claim: one class at a time, oldest first.
        Index("ix_runs_priority_created_at_unclaimed", "priority", "created_at",
              postgresql_where=text(UNCLAIMED)),
        # The ladder's measured drain rate (a model's runs claimed in the last seconds) and the canary
        # guard's samples (every run it judges was claimed).
        Index("ix_runs_model_version_queued_at", "model_version", "queued_at",
              postgresql_where=text("queued_at IS NOT NULL")),
        # The reaper's scan for settled runs whose TERMINAL event was never confirmed published. Keyed
        # by id, not lease_expires_at: a lease renewal then changes no indexed column and is a HOT
        # update (migration 0012); the predicate keeps the index to a handful of rows.
        Index("ix_runs_id_unpublished", "id", postgresql_where=text(_UNPUBLISHED_TERMINAL_CHECK)),
        # Room on each page for the new versions of its rows (renewals, transitions): HOT updates.
        {"postgresql_with": {"fillfactor": 70}},
    )

    @property
    def run_status(self) -> RunStatus:
        return RunStatus(self.status)


class Budget(Base):
    """A tenant's token and cost budget for one period (the UTC calendar month)."""

    __tablename__ = "budgets"

    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    period_start: Mapped[dt.date] = mapped_column(Date, primary_key=True)  # first day of the UTC month
    token_budget: Mapped[int] = mapped_column(BigInteger)
    cost_budget_micros: Mapped[int] = mapped_column(BigInteger)
    reserved_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    used_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    reserved_cost_micros: Mapped[int] = mapped_column(BigInteger, server_default="0")
    used_cost_micros: Mapped[int] = mapped_column(BigInteger, server_default="0")

    __table_args__ = (
        CheckConstraint(
            "reserved_tokens >= 0 AND used_tokens >= 0"
            " AND reserved_cost_micros >= 0 AND used_cost_micros >= 0",
            name="amounts_non_negative",
        ),
    )


class UsageEntry(Base):
    """What one terminal run consumed and cost; at most one per run (the exactly-once guard)."""

    __tablename__ = "usage_entries"

    id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), primary_key=True, default=uuid.uuid4, server_default=text("gen_random_uuid()")
    )
    run_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("runs.id"), unique=True)
    # The tenant, model and price card are copied from the run by the settlement statement; the run's
    # own foreign keys hold them (none here since migration 0013: each cost every settlement a lookup
    # that share-locked its parent row, the one models row for every run).
    tenant_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    model_version: Mapped[str] = mapped_column(Text)
    day: Mapped[dt.date] = mapped_column(Date)  # UTC day of settlement
    input_tokens: Mapped[int] = mapped_column(Integer)
    cached_input_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)
    cost_micros: Mapped[int] = mapped_column(BigInteger)
    settled_at: Mapped[dt.datetime] = _timestamp(now=True)
    # Copied from the run: the key that submitted it and the price card the cost follows.
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True), nullable=True)
    price_card_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # Copied from the run's routing decision, so finance can group by why runs went where.
    route_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    worker_pool: Mapped[str | None] = mapped_column(Text, nullable=True)
    quality_tier: Mapped[str | None] = mapped_column(Text, nullable=True)

    __table_args__ = (
        Index("ix_usage_entries_tenant_id_day", "tenant_id", "day"),
        # Finance's export over every tenant scans a time range.
        Index("ix_usage_entries_settled_at", "settled_at"),
    )


class AuditEntry(Base):
    """One admin change: who made it, what, the state before and after, when. Written in the
    transaction that makes the change, so no change commits without its row."""

    __tablename__ = "admin_audit"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = _timestamp(now=True)
    actor_key_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True), nullable=True)
    actor_key_prefix: Mapped[str] = mapped_column(Text)
    action: Mapped[str] = mapped_column(Text)    # e.g. "api_key.revoke"
    target: Mapped[str] = mapped_column(Text)    # what it acted on: a tenant name, key prefix, ...
    before: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)


class ReplicaRow(Base):
    """The durable replica registry every routing process follows (config [[replicas]] is the
    bootstrap underneath). A removal is a tombstone (`removed`), so a process that syncs by
    `revision` sees it, and a configured replica stays removed."""

    __tablename__ = "replicas"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    pool: Mapped[str] = mapped_column(Text, server_default="")
    grpc_address: Mapped[str] = mapped_column(Text, server_default="")
    metrics_url: Mapped[str] = mapped_column(Text, server_default="")
    block_size: Mapped[int] = mapped_column(Integer)
    kv_capacity_blocks: Mapped[int] = mapped_column(BigInteger)
    long_context: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # serving | warm | draining: the autoscaler's view of the replica; routing sends new runs only
    # to serving ones (sluice.router.registry).
    state: Mapped[str] = mapped_column(Text, server_default="serving")
    removed: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # Bumped from one sequence on every write: a syncing process asks for revision > last seen.
    revision: Mapped[int] = mapped_column(
        BigInteger, server_default=text("nextval('replicas_revision_seq')"), index=True
    )
    updated_at: Mapped[dt.datetime] = _timestamp(now=True)


class TenantFallback(Base):
    """A model a tenant accepts instead of the one requested, and when (sluice/traffic/fallback.py).
    Set by an admin (Admin.SetFallbacks); a request may only narrow it."""

    __tablename__ = "tenant_fallbacks"

    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    from_model: Mapped[str] = mapped_column(Text, primary_key=True)   # alias or version requested
    to_model: Mapped[str] = mapped_column(Text, primary_key=True)     # alias or version accepted
    position: Mapped[int] = mapped_column(Integer)                    # tried in this order
    conditions: Mapped[list[str]] = mapped_column(ARRAY(Text))        # of backlog, deadline

    __table_args__ = (
        CheckConstraint("from_model <> to_model", name="not_itself"),
        CheckConstraint("cardinality(conditions) > 0 AND conditions <@ ARRAY['backlog', 'deadline']::text[]",
                        name="conditions_known"),
    )


class CanaryState(enum.StrEnum):
    ACTIVE = "active"                # share_bp of the alias's new runs go to the candidate
    ROLLED_BACK = "rolled_back"      # a guardrail tripped (or an admin stopped it): share 0
    PROMOTED = "promoted"            # the alias moved to the candidate


class Canary(Base):
    """An alias's canary: a share of its new runs goes to a candidate version until the guardrails
    (sluice/traffic/canary.py) roll it back or an admin promotes it. One row per alias; starting a
    new canary on the alias replaces an ended one. `reason` says why it ended."""

    __tablename__ = "canaries"

    alias: Mapped[str] = mapped_column(Text, primary_key=True)
    baseline_version: Mapped[str] = mapped_column(ForeignKey("models.version"))
    candidate_version: Mapped[str] = mapped_column(ForeignKey("models.version"))
    share_bp: Mapped[int] = mapped_column(Integer)      # basis points of new runs: 2,000 = 20%
    state: Mapped[str] = mapped_column(Text, server_default=CanaryState.ACTIVE.value)
    # Guardrails (traffic.canary.Guardrails): the window, samples per arm, and the limits.
    window_s: Mapped[float] = mapped_column(Float)
    min_samples: Mapped[int] = mapped_column(Integer)
    max_ttft_ratio: Mapped[float] = mapped_column(Float)
    max_tpot_ratio: Mapped[float] = mapped_column(Float)
    max_failure_rate_increase: Mapped[float] = mapped_column(Float)
    started_at: Mapped[dt.datetime] = _timestamp(now=True)
    ended_at: Mapped[dt.datetime | None] = _timestamp(nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)    # why it ended
    # The last evaluation: verdict and each arm's counts and p95s (what the reason was judged on).
    last_judgment: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)
    judged_at: Mapped[dt.datetime | None] = _timestamp(nullable=True)

    __table_args__ = (
        CheckConstraint("share_bp BETWEEN 0 AND 10000", name="share_in_range"),
        CheckConstraint(_in_list("state", [s.value for s in CanaryState]), name="state_known"),
        CheckConstraint("baseline_version <> candidate_version", name="two_versions"),
        CheckConstraint(f"state = '{CanaryState.ACTIVE.value}' OR share_bp = 0", name="ended_at_zero"),
    )
