"""The claim's statements (issue 9: the routing worker's cost per run), one round trip each.

    any_accepted       a timer's poll asks first, in one autocommit round trip, whether any run
                       waits at all (most polls of an idle worker end here)
    BEGIN
    lock_accepted      both priority classes in one statement: the oldest interactive runs, then
                       batch runs with what is left of the pass, row-locked (SKIP LOCKED)
    [kv budgets]       only when a locked run's tenant has a GPU-memory budget (two statements:
                       the tenants locked, then what their claimed runs hold, read after the lock)
    queue_runs         every run routed in the pass ACCEPTED -> QUEUED + replica + lease, new epoch
    COMMIT

Written once with :name parameters (ledger/pg.Statement): prepared once per hot connection, and
runnable in a SQLAlchemy transaction by the tests and rare callers.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from sluice.ledger.models import unclaimed, unfinished
from sluice.ledger.pg import Executor, Statement, rows_of

# The partial indexes' predicates, named so that the plans can use those indexes (ledger/models.py).
_PREDICATES = {"unclaimed": unclaimed("r."), "unfinished": unfinished("h.")}

# Each class from its own partial index (ix_runs_priority_created_at_unclaimed), oldest first; the
# batch CTE takes only what the interactive one left of `limit`. A run is left out unless its
# deadline passed (it is then ended EXPIRED, not claimed) when it would overflow its tenant's
# GPU-memory budget given what its claimed runs hold now (a pre-selection: the exact check is made
# under the tenant's lock), and, for batch, when its pool is in :excluding (no headroom).
_ELIGIBLE = """
    SELECT {klass} AS class, r.id, r.tenant_id, r.model_version, r.prompt_token_ids, r.input_tokens,
           r.max_output_tokens, r.conversation_id, r.deadline_at, r.created_at, r.cache_scope, r.sampling,
           r.lease_epoch, m.worker_pool, m.tokenizer, m.end_id, r.traceparent, r.priority, t.kv_token_budget,
           r.worker_pool AS route_pool, r.quality_tier AS route_tier, r.route_reason, r.requested_model,
           r.fallback_from, r.route_detail
      FROM runs r JOIN models m ON m.version = r.model_version JOIN tenants t ON t.id = r.tenant_id
     WHERE r.status = 'ACCEPTED' AND {unclaimed} AND r.priority = '{priority}'{pools}
       AND (t.kv_token_budget IS NULL OR r.deadline_at <= now()
            OR (SELECT COALESCE(sum(h.input_tokens + h.max_output_tokens), 0) FROM runs h
                 WHERE h.tenant_id = r.tenant_id AND h.status IN ('QUEUED', 'RUNNING') AND {unfinished})
               + r.input_tokens + r.max_output_tokens <= t.kv_token_budget)
     ORDER BY r.created_at
"""
# The locked rows carry every column the claim needs: no second look at runs.
_LOCK_ACCEPTED = Statement.of(f"""
WITH interactive AS ({_ELIGIBLE.format(klass=0, priority='interactive', pools='', **_PREDICATES)}
     LIMIT :limit
       FOR UPDATE OF r SKIP LOCKED
), batch AS ({_ELIGIBLE.format(klass=1, priority='batch', pools='''
       AND (m.worker_pool <> ALL(CAST(:excluding AS text[])) OR r.deadline_at <= now())''', **_PREDICATES)}
     LIMIT GREATEST(:limit - (SELECT count(*) FROM interactive), 0)
       FOR UPDATE OF r SKIP LOCKED
)
SELECT * FROM interactive UNION ALL SELECT * FROM batch
 ORDER BY class, created_at
""")

# From the claim's partial index (runs not yet claimed only): no plan or scan worth the name.
_ANY_ACCEPTED = Statement.of(
    f"SELECT EXISTS (SELECT 1 FROM runs WHERE status = 'ACCEPTED' AND {unclaimed()}) AS waiting")

# FOR NO KEY UPDATE, as admission's lock: it does not block the FOR KEY SHARE lock inserting a run
# takes. The sums are a second statement on purpose: in READ COMMITTED a statement's snapshot is
# taken before it waits for a lock, so only a statement begun after the lock sees the claims the
# previous holder committed.
_LOCK_BUDGETS = Statement.of("""
SELECT id, kv_token_budget FROM tenants
 WHERE id = ANY(CAST(:tenants AS uuid[])) AND kv_token_budget IS NOT NULL
 ORDER BY id
   FOR NO KEY UPDATE
""")
_HELD = Statement.of(f"""
SELECT tenant_id, sum(input_tokens + max_output_tokens) AS held FROM runs
 WHERE tenant_id = ANY(CAST(:tenants AS uuid[])) AND status IN ('QUEUED', 'RUNNING') AND {unfinished()}
 GROUP BY tenant_id
""")

# The lease runs from the transaction's start (now()): a deadline the worker counts from before its
# BEGIN is never later than the ledger's. queued_at is when the run was taken (clock_timestamp()):
# the locks that decided it (a tenant's GPU-memory budget freed by a run that ended meanwhile) may
# have been waited for after BEGIN, and a run must not read as taken before what let it go.
# `id = ANY(ids)` beside the join keeps the generic plan on the primary key (as runs_sql's writes):
# joined to `unnest` alone (10 rows assumed), the plan may scan runs whole, the more so since no index
# filters by status (migration 0013).
_QUEUE = Statement.of("""
UPDATE runs AS r
   SET status = 'QUEUED', queued_at = clock_timestamp(), replica = q.replica, lease_owner = :owner,
       lease_expires_at = now() + make_interval(secs => :lease_seconds), lease_epoch = r.lease_epoch + 1
  FROM unnest(CAST(:ids AS uuid[]), CAST(:replicas AS text[])) AS q(id, replica)
 WHERE r.id = ANY(CAST(:ids AS uuid[])) AND r.id = q.id AND r.status = 'ACCEPTED'
RETURNING r.id, r.queued_at, r.lease_epoch
""")


async def any_accepted(executor: Executor) -> bool:
    """Whether any run is ACCEPTED (whatever its pool or class), without locking anything."""
    row = await rows_of(executor).row(_ANY_ACCEPTED, {})
    return bool(row and row["waiting"])


async def lock_accepted(executor: Executor, limit: int,
                        excluding_pools: Collection[str] = ()) -> list[Mapping[str, Any]]:
    """Up to `limit` ACCEPTED runs nobody else is claiming, interactive first (oldest first), locked
    until the transaction ends; batch runs of `excluding_pools` only once their deadline passed."""
    return await rows_of(executor).rows(_LOCK_ACCEPTED, {"limit": limit, "excluding": list(excluding_pools)})


async def lock_budgets(executor: Executor, tenants: Collection[uuid.UUID]) -> tuple[
        dict[str, int | None], dict[str, int]]:
    """(tenant -> kv_token_budget, tenant -> KV tokens its claimed runs hold) for the tenants among
    `tenants` that have a budget, those locked until the transaction ends."""
    rows = rows_of(executor)
    locked = await rows.rows(_LOCK_BUDGETS, {"tenants": sorted(tenants)})
    budgets: dict[str, int | None] = {str(row["id"]): row["kv_token_budget"] for row in locked}
    if not budgets:
        return {}, {}
    sums = await rows.rows(_HELD, {"tenants": [uuid.UUID(tenant) for tenant in budgets]})
    return budgets, {str(row["tenant_id"]): int(row["held"]) for row in sums}


async def queue_runs(executor: Executor, replicas: Mapping[uuid.UUID, str], owner: str,
                     lease_seconds: float) -> dict[uuid.UUID, tuple[dt.datetime, int]]:
    """ACCEPTED -> QUEUED on the replica each run was routed to, leased to `owner` under a new epoch,
    in one statement; returns run -> (queued_at, epoch) for the runs that were still ACCEPTED."""
    ids: Sequence[uuid.UUID] = list(replicas)
    found = await rows_of(executor).rows(_QUEUE, {
        "ids": ids, "replicas": [replicas[run_id] for run_id in ids], "owner": owner,
        "lease_seconds": float(lease_seconds)})
    return {uuid.UUID(str(row["id"])): (row["queued_at"], int(row["lease_epoch"])) for row in found}
