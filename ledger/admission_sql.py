"""Submit's hot path in two statements, each its own autocommit round trip (one, the write with its
checks, when the gateway decided on a context it read a moment ago: _WRITE_HELD below).

    read   API key → caller (key, scope, tenant), alias/version → model, its backlog  (one SELECT)
           ... the caller checks, tokenizes and prices outside any transaction ...
    write  reserve on the budget row AND insert the run                       (one statement)

The write is atomic without BEGIN/COMMIT because it is one statement:

    WITH reserved AS (UPDATE budgets ... WHERE it fits RETURNING ...)
    INSERT INTO runs SELECT ... FROM reserved RETURNING id, pg_notify(...)

- fits, new request key: one budget row updated, one run inserted, committed together
  (the NOTIFY in RETURNING is delivered at that commit);
- does not fit, or no budget row for this period: nothing reserved, nothing inserted
  (None: the caller takes the transactional path, which opens a period or explains the refusal);
- request key already used: the INSERT's unique violation aborts the whole statement, the
  reservation included (IntegrityError: the caller takes the transactional path, which gives
  the idempotent answer). A concurrent duplicate waits on the unique index for the first to
  commit, then fails the same way: no interleaving reserves twice or leaks a reservation.

The budget row lock is held from the UPDATE to the statement's end, as it was to COMMIT.
Both statements run on a raw asyncpg connection of the gateway's HotPool (ledger/pg.py), which
prepares each once per connection: ~60 us of client CPU a statement instead of ~600 us for a
SQLAlchemy checkout and statement (issue 9). The rarer statements (the ladder's drain count, the
transactional path) stay on SQLAlchemy.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg
from sluice.ledger.keys import matches, salted_prefix, unsalted_hash
from sluice.ledger.models import RunStatus, unclaimed
from sluice.ledger.pg import Statement, rows_of
from sluice.ledger.repositories import Caller, ModelInfo, caller_of
from sqlalchemy import bindparam, text
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.types import Float

from sluice.traffic.canary import SHARE_SCALE
from sluice.traffic.route import RouteReason

# The backlog counts name the partial index's predicate (ix_runs_model_version_priority_unclaimed), so
# the plan can use it; the status stays a literal beside it.


def _waiting(version: str, priority: str, limit: str) -> str:
    """A model's unclaimed ACCEPTED runs of one priority, counted up to `limit` (SQL expressions)."""
    return f"""(SELECT count(*) FROM (SELECT 1 FROM runs r
                              WHERE r.model_version = {version} AND r.status = '{RunStatus.ACCEPTED.value}'
                                AND {unclaimed("r.")} AND r.priority = '{priority}'
                              LIMIT {limit}) AS waiting)"""


# The key is found as ApiKeyRepository.caller finds it (ledger/repositories.py): an unsalted key by
# its hash, a salted one by its public prefix, then checked against its salted hash here in Python.
_READ = Statement.of(f"""
SELECT t.id AS tenant_id, k.id AS key_id, k.key_prefix, k.key_hash, k.key_salt, k.scope,
       t.name AS tenant_name, t.allowed_tiers, t.max_concurrent_runs,
       t.tokens_per_minute, t.shared_cache_scope, t.suspended_at, t.batch_allowed, t.kv_token_budget,
       m.version, m.alias, m.tokenizer, m.context_limit, m.worker_pool, m.quality_tier, m.end_id,
       m.price_input_per_m_micros, m.price_cached_input_per_m_micros, m.price_output_per_m_micros,
       m.price_card_id, m.canary_share_bp, m.canary_baseline,
       CAST(t.xmin AS text) AS tenant_row, m.model_row,
       EXISTS (SELECT 1 FROM canaries ca WHERE ca.alias = :name AND ca.state = 'active') AS canary_active,
       {_waiting("m.version", "interactive", ":backlog_limit")} AS backlog,
       {_waiting("m.version", "batch", ":batch_backlog_limit")} AS batch_backlog
FROM api_keys k
LEFT JOIN tenants t ON t.id = k.tenant_id
LEFT JOIN LATERAL (
    -- An exact version wins over an alias of the same spelling; an alias with an active canary
    -- whose share covers this run's split point resolves to the candidate, else to its holder.
    SELECT mv.*, CAST(mv.xmin AS text) AS model_row, c.share_bp AS canary_share_bp,
           c.baseline_version AS canary_baseline
    FROM models mv
    LEFT JOIN canaries c ON c.alias = :name AND c.state = 'active' AND c.candidate_version = mv.version
                        AND :split_point < c.share_bp
    WHERE (mv.version = :name OR mv.alias = :name OR c.alias IS NOT NULL) AND mv.retired_at IS NULL
    ORDER BY mv.version = :name DESC, c.alias IS NOT NULL DESC
    LIMIT 1
) m ON true
WHERE ((k.key_hash = :key_hash AND k.key_salt IS NULL)
       OR (k.key_prefix = :key_prefix AND k.key_salt IS NOT NULL))
  AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now())
""")

# Reserve on the budget row AND insert the run: the reservation only where it fits ({held}: a further
# condition, the cached context's check below), the run only with a reservation.
_RESERVE_AND_INSERT = f"""
reserved AS (
    UPDATE budgets
       SET reserved_tokens = reserved_tokens + :reserved_tokens,
           reserved_cost_micros = reserved_cost_micros + :reserved_cost_micros
     WHERE tenant_id = :tenant_id
       AND period_start = CAST(date_trunc('month', timezone('UTC', now())) AS date)
       AND reserved_tokens + used_tokens + :reserved_tokens <= token_budget
       AND reserved_cost_micros + used_cost_micros + :reserved_cost_micros <= cost_budget_micros{{held}}
    RETURNING tenant_id, token_budget - reserved_tokens - used_tokens AS tokens_left,
              cost_budget_micros - reserved_cost_micros - used_cost_micros AS cost_left_micros
), inserted AS (
    INSERT INTO runs (id, tenant_id, request_key, payload_hash, model_version, status, prompt_token_ids,
                      input_tokens, max_output_tokens, sampling, conversation_id, cache_scope, deadline_at,
                      reserved_tokens, reserved_cost_micros, api_key_id, price_card_id,
                      requested_model, route_reason, worker_pool, quality_tier, fallback_from, route_detail,
                      traceparent, priority)
    SELECT :id, tenant_id, :request_key, :payload_hash, :model_version, '{RunStatus.ACCEPTED.value}',
           :prompt_token_ids, :input_tokens, :max_output_tokens, :sampling, :conversation_id, :cache_scope,
           now() + :deadline_ms * interval '1 millisecond', :reserved_tokens, :reserved_cost_micros,
           :api_key_id, :price_card_id,
           :requested_model, :route_reason, :worker_pool, :quality_tier, :fallback_from, :route_detail,
           :traceparent, :priority
    FROM reserved
    RETURNING id, pg_notify(:channel, :pool)
)"""

_WRITE = Statement.of(f"""
WITH {_RESERVE_AND_INSERT.format(held="")}
SELECT inserted.id, reserved.tokens_left, reserved.cost_left_micros FROM inserted CROSS JOIN reserved
""")

# The write of a Submit decided on a cached context (services/submit_contexts.py) instead of a read:
# it first checks, in its own snapshot, everything the decision took from the cache, and writes only
# if all of it still holds. The key: still this tenant's, of this scope, not revoked, not expired. The
# tenant and the model version: the very row versions read (xmin: any admin change to a row makes a
# new one). The name: still resolves to that version, with no canary on it. The backlogs: within the
# bounds under which the decision is the same (services/admission_rules.backlog_bounds). `held` false:
# nothing was written and the caller decides again on a fresh read; true with no id: as for _WRITE.
_WRITE_HELD = Statement.of(f"""
WITH counted AS (
    SELECT {_waiting(":model_version", "interactive", ":backlog_bound + 1")} AS backlog,
           {_waiting(":model_version", "batch", ":batch_count_limit")} AS batch_backlog
), held AS (
    SELECT backlog FROM counted
     WHERE backlog <= :backlog_bound AND batch_backlog <= :batch_backlog_bound
       AND backlog + batch_backlog <= :waiting_bound
       AND EXISTS (SELECT 1 FROM api_keys k
                    WHERE k.id = :api_key_id AND k.tenant_id = :tenant_id AND k.scope = :scope
                      AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now()))
       AND EXISTS (SELECT 1 FROM tenants t WHERE t.id = :tenant_id AND CAST(t.xmin AS text) = :tenant_row)
       AND NOT EXISTS (SELECT 1 FROM canaries ca WHERE ca.alias = :requested_model AND ca.state = 'active')
       AND EXISTS (SELECT 1 FROM (SELECT mv.version, mv.xmin FROM models mv
                                   WHERE (mv.version = :requested_model OR mv.alias = :requested_model)
                                     AND mv.retired_at IS NULL
                                   ORDER BY mv.version = :requested_model DESC
                                   LIMIT 1) AS resolved
                    WHERE resolved.version = :model_version AND CAST(resolved.xmin AS text) = :model_row)
), {_RESERVE_AND_INSERT.format(held=" AND EXISTS (SELECT 1 FROM held)")}
SELECT (SELECT id FROM inserted) AS id, (SELECT tokens_left FROM reserved) AS tokens_left,
       (SELECT cost_left_micros FROM reserved) AS cost_left_micros,
       (SELECT backlog FROM held) AS held_backlog
""")



@dataclass(frozen=True, slots=True)
class SubmitContext:
    """What the read found; caller None: the key is unknown, revoked or expired."""

    caller: Caller | None
    model: ModelInfo | None          # None: no model (not retired) has that alias or version
    backlog: int                     # the model's interactive ACCEPTED runs, counted up to the limit asked
    reason: RouteReason = RouteReason.REQUESTED   # how the name resolved to `model`
    canary: str = ""                 # CANARY: the split, for the run's route detail
    batch_backlog: int = 0           # its batch ACCEPTED runs, counted up to the batch limit asked
    versions: RowVersions | None = None   # the tenant and model rows read (None: no model)
    canary_active: bool = False      # an active canary splits the name asked for


@dataclass(frozen=True, slots=True)
class RowVersions:
    """Which versions of the tenant's and the model's rows a context was read from (their xmin: an
    UPDATE makes a new row version, so any admin change to either shows as a new value)."""

    tenant: str
    model: str


@dataclass(frozen=True, slots=True)
class BacklogBounds:
    """The backlogs under which a submit decided at no backlog is decided the same way."""

    backlog: int                     # interactive ACCEPTED runs of the model, at most
    batch: int                       # batch ACCEPTED runs, at most (counted only if count_batch)
    waiting: int                     # the two together, at most
    count_batch: bool                # False: the batch backlog does not matter (counted as 0)


@dataclass(frozen=True, slots=True)
class HeldWrite:
    """What the write of a Submit decided on a cached context did."""

    held: bool                       # False: what the decision took from the cache changed; nothing written
    reserved: Reserved | None        # the run written (None, held: as insert_reserving's None)
    backlog: int = 0                 # the model's interactive backlog, as the write counted it


async def read_submit_context(connection: asyncpg.Connection, key: str, model_name: str,
                              backlog_limit: int, split_point: int = SHARE_SCALE,
                              batch_backlog_limit: int = 1) -> SubmitContext:
    """`split_point` is the run's sticky point for a canary split (traffic.canary.split_point); the
    default is past every share, so the alias resolves to its holder."""
    rows = await rows_of(connection).rows(_READ, {
        "key_hash": unsalted_hash(key), "key_prefix": salted_prefix(key), "name": model_name,
        "backlog_limit": backlog_limit, "split_point": split_point,
        "batch_backlog_limit": batch_backlog_limit})
    row = next((_Row(row) for row in rows if matches(key, row["key_hash"], row["key_salt"])), None)
    if row is None:
        return SubmitContext(None, None, 0)
    # No last_used_at write here: the hot path stays two statements (the other services record use).
    caller = caller_of(row)
    if row.version is None:
        return SubmitContext(caller, None, 0)
    model = model_info_of(row)
    backlog, batch = int(row.backlog), int(row.batch_backlog)
    versions, canary_active = RowVersions(row.tenant_row or "", row.model_row), bool(row.canary_active)
    if row.version == model_name:
        return SubmitContext(caller, model, backlog, RouteReason.REQUESTED, batch_backlog=batch,
                             versions=versions, canary_active=canary_active)
    if row.canary_share_bp is None:
        return SubmitContext(caller, model, backlog, RouteReason.ALIAS, batch_backlog=batch,
                             versions=versions, canary_active=canary_active)
    split = (f"canary of {model_name}: {row.canary_share_bp / 100:g}% of new runs to {row.version}"
             f" (baseline {row.canary_baseline})")
    return SubmitContext(caller, model, backlog, RouteReason.CANARY, split, batch_backlog=batch,
                         versions=versions, canary_active=canary_active)


@dataclass(frozen=True, slots=True)
class _Row:
    """An asyncpg record read by attribute, as caller_of and model_info_of read SQLAlchemy rows."""

    record: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.record[name]
        except KeyError:
            raise AttributeError(name) from None


def model_info_of(row: Any) -> ModelInfo:
    """A models row read by a text statement (its columns by name) as the record admission uses."""
    return ModelInfo(
        version=row.version, alias=row.alias, tokenizer=row.tokenizer, context_limit=row.context_limit,
        worker_pool=row.worker_pool, quality_tier=row.quality_tier, end_id=row.end_id,
        price_input_per_m_micros=row.price_input_per_m_micros,
        price_cached_input_per_m_micros=row.price_cached_input_per_m_micros,
        price_output_per_m_micros=row.price_output_per_m_micros, price_card_id=row.price_card_id)


@dataclass(frozen=True, slots=True)
class Reserved:
    """A run inserted with its reservation, and what the tenant's period has left after it."""

    run_id: uuid.UUID
    tokens_left: int
    cost_left_micros: int


_DRAINED = text("""
SELECT count(*) FROM runs WHERE model_version = :model_version
                            AND queued_at > now() - :window_s * interval '1 second'
""").bindparams(bindparam("window_s", type_=Float))


async def drained_runs(connection: AsyncConnection, model_version: str, window_s: float) -> int:
    """Runs of the model claimed by routing workers in the last `window_s` (the ladder's measured drain;
    read only when a submit is about to be shed, so the hot path never pays it)."""
    return int((await connection.execute(_DRAINED, {"model_version": model_version,
                                                    "window_s": float(window_s)})).scalar_one())


async def insert_reserving(connection: asyncpg.Connection, run: Mapping[str, Any], deadline_ms: int,
                           notify: tuple[str, str]) -> Reserved | None:
    """Reserve run["reserved_tokens"/"reserved_cost_micros"] and insert the run, atomically, on a
    connection outside any transaction. The run and the budget left, or None when nothing was
    written: the reservation does not fit the current period, there is no period yet, or the
    request key is taken (the unique index aborts the whole statement; the transactional path
    then tells which and answers).

    `run` holds the runs columns the statement names (id, tenant_id, request_key, ...), the prompt's
    token ids as stored (ledger/token_ids.py: admission tokenizes straight into that form)."""
    channel, pool = notify
    try:
        row = await rows_of(connection).row(_WRITE, {**run, "deadline_ms": deadline_ms,
                                                     "channel": channel, "pool": pool})
    except asyncpg.IntegrityConstraintViolationError:
        return None
    return None if row is None else Reserved(row["id"], int(row["tokens_left"]), int(row["cost_left_micros"]))


async def insert_reserving_if_held(connection: asyncpg.Connection, run: Mapping[str, Any], deadline_ms: int,
                                   notify: tuple[str, str], *, scope: str, versions: RowVersions,
                                   bounds: BacklogBounds) -> HeldWrite:
    """insert_reserving for a submit decided on a cached context: written only if, in the statement's
    own snapshot, the key (`run["api_key_id"]`, of `scope`) is still good, the tenant and model rows
    are still at `versions`, the name asked for still resolves to the model with no canary, and the
    backlogs are within `bounds`. A request key already taken counts as not held (the caller's fresh
    read then authenticates the key before the idempotent answer is given)."""
    channel, pool = notify
    try:
        row = await rows_of(connection).row(_WRITE_HELD, {
            **run, "deadline_ms": deadline_ms, "channel": channel, "pool": pool, "scope": scope,
            "tenant_row": versions.tenant, "model_row": versions.model,
            "backlog_bound": bounds.backlog, "batch_backlog_bound": bounds.batch,
            "batch_count_limit": bounds.batch + 1 if bounds.count_batch else 0,
            "waiting_bound": bounds.waiting})
    except asyncpg.IntegrityConstraintViolationError:
        return HeldWrite(False, None)
    if row is None or row["held_backlog"] is None:
        return HeldWrite(False, None)
    reserved = None if row["id"] is None else \
        Reserved(row["id"], int(row["tokens_left"]), int(row["cost_left_micros"]))
    return HeldWrite(True, reserved, int(row["held_backlog"]))
