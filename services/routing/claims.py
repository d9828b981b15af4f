"""Ledger statements of the routing service. Each takes the caller's session or hot connection
(ledger/pg.py); the caller owns the transaction (STYLE 7), so every boundary is visible in
worker.py, driver.py and services/finish.py. The claim's own SQL is in ledger/claims_sql.py.

Ownership of an active run is its lease: `lease_owner` names the routing
process driving it, `lease_expires_at` says until when, and `lease_epoch` is
the fencing token, one more each time a process takes the run. Every write a
driver makes is conditioned on the epoch it was granted, so a driver that was
presumed dead (its lease expired and a reaper took the run) can never move the
run again. Lease renewal itself is in leases.py (its own connection).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.ledger import claims_sql, token_ids
from sluice.ledger.models import Run, RunStatus, unfinished
from sluice.ledger.pg import Executor, Statement, rows_of
from sluice.ledger.routes import route_from_columns
from sluice.services.admission_rules import ENGINE_DEFAULT, Sampling
from sluice.services.errors import DETAIL_EXPIRED_WAITING_HEADROOM, DETAIL_EXPIRED_WAITING_KV_BUDGET
from sqlalchemy import Float, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from sluice.eventlog.interface import LogPosition
from sluice.traffic.gpu_budget import Candidate, claimable, kv_tokens
from sluice.traffic.priority import Priority
from sluice.traffic.route import RouteRecord

ACTIVE_CLAIMED = (RunStatus.QUEUED.value, RunStatus.RUNNING.value)
DETAIL_EXPIRED_BEFORE_START = "deadline passed before a replica took the run"


@dataclass(frozen=True, slots=True)
class ClaimedRun:
    """What a driver needs to run one claimed run; read inside the claiming transaction."""

    run_id: str
    tenant_id: uuid.UUID
    model_version: str
    worker_pool: str
    tokenizer: str               # tokenizer.json path, relative to the repo root
    end_id: int
    prompt_token_ids: tuple[int, ...]
    input_tokens: int
    max_output_tokens: int
    conversation_id: str | None
    deadline_at: dt.datetime
    replica: str | None          # set once routed (changed by a retry before the first token)
    queued_at: dt.datetime | None
    created_at: dt.datetime | None = None   # the submit (TTFT runs from here)
    cache_salt: int = 0          # the run's trust scope as the replica's cache_salt_id (trust_scope.py)
    epoch: int = 0               # the lease epoch this claim was granted (fencing token)
    sampling: Sampling = ENGINE_DEFAULT   # the submit's, from runs.sampling; 0 = the replica's default
    route: RouteRecord | None = None     # the routing decision admission recorded (None: before 0008)
    traceparent: str | None = None        # the Submit span's (runs.traceparent): this run's trace


@dataclass(frozen=True, slots=True)
class AcceptedRun:
    """An ACCEPTED run locked for claiming: the columns routing and the driver need, no ORM row."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    model_version: str
    prompt_token_ids: tuple[int, ...]
    input_tokens: int
    max_output_tokens: int
    conversation_id: str | None
    deadline_at: dt.datetime
    created_at: dt.datetime
    cache_scope: str | None
    sampling: dict[str, Any]     # runs.sampling (JSONB, '{}' by default)
    lease_epoch: int
    worker_pool: str             # its model's
    tokenizer: str
    end_id: int
    route: RouteRecord | None    # the routing decision admission recorded (None: before 0008)
    traceparent: str | None      # the Submit span's W3C traceparent (None: not traced)
    priority: str = Priority.INTERACTIVE.value   # interactive | batch
    kv_token_budget: int | None = None           # its tenant's, as the claim read it (None: no cap)


def accepted_run(row: Mapping[str, Any]) -> AcceptedRun:
    """An AcceptedRun from a row of ledger/claims_sql.lock_accepted."""
    return AcceptedRun(
        id=uuid.UUID(str(row["id"])), tenant_id=uuid.UUID(str(row["tenant_id"])),
        model_version=row["model_version"], prompt_token_ids=token_ids.unpack(row["prompt_token_ids"]),
        input_tokens=row["input_tokens"], max_output_tokens=row["max_output_tokens"],
        conversation_id=row["conversation_id"], deadline_at=row["deadline_at"], created_at=row["created_at"],
        cache_scope=row["cache_scope"], sampling=row["sampling"], lease_epoch=row["lease_epoch"],
        worker_pool=row["worker_pool"], tokenizer=row["tokenizer"], end_id=row["end_id"],
        priority=row["priority"], kv_token_budget=row["kv_token_budget"],
        route=route_from_columns(row["model_version"], row["route_pool"], row["route_tier"],
                                 row["route_reason"], row["requested_model"], row["fallback_from"],
                                 row["route_detail"]),
        traceparent=row["traceparent"])


async def lock_accepted(executor: Executor, limit: int,
                        excluding_pools: Collection[str] = ()) -> list[AcceptedRun]:
    """Oldest ACCEPTED runs nobody else is claiming right now, interactive before batch, row-locked
    for this transaction, in one statement (ledger/claims_sql.py).

    SKIP LOCKED lets several routing processes claim concurrently without waiting on each other or
    taking the same run twice. Batch runs come only with what the interactive ones left of `limit`,
    and not from `excluding_pools` (no headroom). Left out, unless their deadline has passed (they
    are taken to be ended EXPIRED): runs that would overflow their tenant's GPU-memory budget given
    what its claimed runs hold now (sluice/traffic/gpu_budget.py), so a tenant at its cap never fills
    a claim batch with runs that must wait. This filter is a pre-selection; the exact check is made
    under the tenant's lock (lock_kv_budgets).
    """
    return [accepted_run(row) for row in await claims_sql.lock_accepted(executor, limit, excluding_pools)]


@dataclass(frozen=True, slots=True)
class KvBudgets:
    """The GPU-memory budgets of some tenants and the KV tokens their claimed runs hold now."""

    budgets: dict[str, int | None]      # tenant id → kv_token_budget (tenants without one: absent)
    held: dict[str, int]                # tenant id → Σ input + output cap over its QUEUED/RUNNING runs


async def lock_kv_budgets(executor: Executor, runs: Sequence[AcceptedRun]) -> KvBudgets:
    """Lock the tenants of `runs` that have a KV token budget (until COMMIT) and read what their
    claimed runs hold. The lock serializes claims for one tenant across routing processes, so two of
    them can never each see room and together overshoot the cap. No round trip when none of them
    had a budget as the runs were locked (the common case)."""
    tenants = {run.tenant_id for run in runs if run.kv_token_budget is not None}
    if not tenants:
        return KvBudgets({}, {})
    budgets, held = await claims_sql.lock_budgets(executor, tenants)
    return KvBudgets(budgets, held)


def within_kv_budgets(rows: Sequence[AcceptedRun], kv: KvBudgets, now: float) -> set[uuid.UUID]:
    """The runs of `rows` (claim order) that fit their tenant's GPU-memory budget taken in order;
    runs past their deadline are left out (they are ended, not claimed)."""
    live = [Candidate(str(run.id), str(run.tenant_id), kv_tokens(run.input_tokens, run.max_output_tokens))
            for run in rows if run.deadline_at.timestamp() > now]
    return {uuid.UUID(key) for key in claimable(live, kv.held, kv.budgets)}


def expiry_detail(priority: str, tenant_id: uuid.UUID, kv: KvBudgets, needed: int, deferred: bool) -> str:
    """Why a run that never reached a replica ran out of time: its tenant's GPU-memory budget, the
    pool's headroom (batch), or simply the queue."""
    budget = kv.budgets.get(str(tenant_id))
    held = kv.held.get(str(tenant_id), 0)
    if budget is not None and held + needed > budget:
        return DETAIL_EXPIRED_WAITING_KV_BUDGET.format(held=held, budget=budget, needed=needed)
    if priority == Priority.BATCH and deferred:
        return DETAIL_EXPIRED_WAITING_HEADROOM
    return DETAIL_EXPIRED_BEFORE_START


async def mark_queued(executor: Executor, run_id: uuid.UUID, replica: str, owner: str,
                      lease_seconds: float) -> tuple[dt.datetime, int]:
    """ACCEPTED → QUEUED on `replica`, leased to `owner` under a new epoch; returns (queued_at,
    epoch). One run of claims_sql.queue_runs (the claim loop queues a whole pass at once)."""
    queued = await claims_sql.queue_runs(executor, {run_id: replica}, owner, lease_seconds)
    assert run_id in queued, f"run {run_id} was locked as ACCEPTED yet could not be queued"
    return queued[run_id]


async def claims_held(session: AsyncSession, granted: dict[str, int], owner: str) -> dict[str, float]:
    """Of the runs `granted` (run id -> epoch of its claim), those the ledger leases to `owner` under
    that epoch, not yet started and with their lease still running, with the seconds it has left by
    the ledger's clock: the claims of a transaction whose COMMIT acknowledgment was lost that did
    commit (the epoch tells this claim from any later one)."""
    rows = await session.execute(
        select(Run.id, Run.lease_epoch,
               func.extract("epoch", Run.lease_expires_at - func.now()).cast(Float).label("remaining_s"))
        .where(Run.id.in_([uuid.UUID(run_id) for run_id in granted]), Run.lease_owner == owner,
               Run.status == RunStatus.QUEUED.value, Run.lease_expires_at > func.now())
    )
    return {str(row.id): float(row.remaining_s) for row in rows
            if granted.get(str(row.id)) == row.lease_epoch}


async def reassign_replica(session: AsyncSession, run_id: str, epoch: int, replica: str) -> bool:
    """Move a QUEUED run (no token yet) to another replica; False if the lease is gone. Committed
    before the new replica is contacted, as the first assignment was: a reaper then stops the
    replica the ledger names."""
    result = await session.execute(
        update(Run)
        .where(Run.id == uuid.UUID(run_id), Run.lease_epoch == epoch, Run.status == RunStatus.QUEUED.value)
        .values(replica=replica)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class TakenRun:
    """A run a reaper leased to itself, with what it needs to end it."""

    run_id: str
    epoch: int                   # the reaper's new epoch
    previous_owner: str          # whose lease lapsed
    replica: str | None
    first: LogPosition | None    # where the run's events start, if the ledger knows
    queued_at: dt.datetime | None
    terminal_sequence: int | None


_TAKE = """
    WITH taken AS (
        SELECT id, lease_owner FROM runs
         WHERE {where}
         ORDER BY lease_expires_at
         LIMIT :limit
           FOR UPDATE SKIP LOCKED
    )
    UPDATE runs AS r
       SET lease_owner = :owner, lease_expires_at = now() + make_interval(secs => :lease_seconds),
           lease_epoch = r.lease_epoch + 1
      FROM taken
     WHERE r.id = taken.id
    RETURNING r.id, r.lease_epoch, taken.lease_owner AS previous_owner, r.replica, r.event_partition,
              r.event_first_offset, r.queued_at, r.terminal_sequence
"""
_TAKE_EXPIRED = Statement.of(_TAKE.format(
    where=f"status IN ('QUEUED', 'RUNNING') AND {unfinished()} AND lease_expires_at < now()"))
_TAKE_UNPUBLISHED = Statement.of(_TAKE.format(
    where="terminal_published = false AND terminal_sequence IS NOT NULL AND lease_expires_at < now()"))


async def take_expired_leases(executor: Executor, owner: str, lease_seconds: float,
                              limit: int) -> list[TakenRun]:
    """Active runs whose lease expired by the ledger's clock, leased to the reaper under a new epoch
    in one statement (atomic on its own: a hot connection runs it without BEGIN/COMMIT), so two
    reapers never end the same run and the old owner is fenced off."""
    return await _take(executor, _TAKE_EXPIRED, owner, lease_seconds, limit)


async def take_unpublished_terminals(executor: Executor, owner: str, lease_seconds: float,
                                     limit: int) -> list[TakenRun]:
    """Terminal runs whose TERMINAL event was never confirmed published, once the lease of
    whoever settled them has lapsed (it may still be publishing until then)."""
    return await _take(executor, _TAKE_UNPUBLISHED, owner, lease_seconds, limit)


async def _take(executor: Executor, statement: Statement, owner: str, lease_seconds: float,
                limit: int) -> list[TakenRun]:
    rows = await rows_of(executor).rows(statement, {"owner": owner, "lease_seconds": float(lease_seconds),
                                                    "limit": limit})
    return [TakenRun(run_id=str(row["id"]), epoch=int(row["lease_epoch"]),
                     previous_owner=row["previous_owner"] or "?", replica=row["replica"],
                     first=None if row["event_partition"] is None or row["event_first_offset"] is None
                     else LogPosition(row["event_partition"], row["event_first_offset"]),
                     queued_at=row["queued_at"], terminal_sequence=row["terminal_sequence"])
            for row in rows]


async def in_flight_by_replica(session: AsyncSession) -> dict[str, int]:
    rows = await session.execute(
        select(Run.replica, func.count()).where(Run.status.in_(ACTIVE_CLAIMED), Run.finished_at.is_(None))
        .group_by(Run.replica)
    )
    return {str(name): int(count) for name, count in rows if name is not None}
