"""Ledger statements of the routing service. Each takes the caller's session; the
caller owns the transaction (STYLE 7), so every boundary is visible in worker.py,
driver.py and services/finish.py.

Ownership of an active run is its lease: `lease_owner` names the routing
process driving it and `lease_expires_at` says until when. Every write a
driver makes is conditioned on still holding the lease, so a driver that was
presumed dead (its lease expired and a reaper took the run) can never move the
run again.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.ledger.channels import EVENTS_CHANNEL
from sluice.ledger.leases import lease_until
from sluice.ledger.models import Model, Run, RunStatus
from sluice.services.notify import notify
from sqlalchemy import Integer, and_, bindparam, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from sluice.eventlog.interface import LogPosition

ACTIVE_CLAIMED = (RunStatus.QUEUED.value, RunStatus.RUNNING.value)


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


async def lock_accepted(session: AsyncSession, limit: int) -> list[tuple[Run, Model]]:
    """Oldest ACCEPTED runs nobody else is claiming right now, row-locked for this transaction.

    SKIP LOCKED lets several routing processes claim concurrently without
    waiting on each other or taking the same run twice.
    """
    rows = await session.execute(
        select(Run, Model)
        .join(Model, Model.version == Run.model_version)
        .where(Run.status == RunStatus.ACCEPTED.value)
        .order_by(Run.created_at)
        .limit(limit)
        .with_for_update(skip_locked=True, of=Run)
    )
    return [(row[0], row[1]) for row in rows]


async def mark_queued(session: AsyncSession, run_id: uuid.UUID, replica: str, owner: str,
                      lease_seconds: float) -> dt.datetime:
    """ACCEPTED → QUEUED on `replica`, leased to `owner`; returns queued_at. Commit before
    contacting the replica: a crash after the commit leaves a run the reaper will end."""
    queued_at = await session.scalar(
        update(Run)
        .where(Run.id == run_id, Run.status == RunStatus.ACCEPTED.value)
        .values(status=RunStatus.QUEUED.value, queued_at=func.now(), replica=replica,
                lease_owner=owner, lease_expires_at=lease_until(lease_seconds))
        .returning(Run.queued_at)
    )
    assert isinstance(queued_at, dt.datetime), f"run {run_id} was locked as ACCEPTED yet could not be queued"
    return queued_at


async def reassign_replica(session: AsyncSession, run_id: str, owner: str, replica: str) -> bool:
    """Move a QUEUED run (no token yet) to another replica; False if the lease is gone. Committed
    before the new replica is contacted, as the first assignment was: a reaper then stops the
    replica the ledger names."""
    result = await session.execute(
        update(Run)
        .where(Run.id == uuid.UUID(run_id), Run.lease_owner == owner, Run.status == RunStatus.QUEUED.value)
        .values(replica=replica)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


async def mark_running(session: AsyncSession, run_id: str, owner: str, first: LogPosition,
                       last_sequence: int) -> bool:
    """QUEUED → RUNNING with where the run's events start; False if the lease is gone.
    Streams waiting for the run's first event are woken when this commits."""
    result = await session.execute(
        update(Run)
        .where(Run.id == uuid.UUID(run_id), Run.lease_owner == owner,
               Run.status == RunStatus.QUEUED.value)
        .values(status=RunStatus.RUNNING.value, started_at=func.now(), event_partition=first.partition,
                event_first_offset=first.offset, last_sequence=last_sequence)
    )
    if not result.rowcount:  # type: ignore[attr-defined]
        return False
    await notify(session, EVENTS_CHANNEL, run_id)
    return True


@dataclass(frozen=True, slots=True)
class LeaseProgress:
    run_id: str
    last_sequence: int           # last event durable in the log
    output_tokens: int           # tokens in durable DELTA events


@dataclass(frozen=True, slots=True)
class LeaseState:
    run_id: str
    cancel_requested: bool


_RENEW = text(
    """
    UPDATE runs AS r
       SET lease_expires_at = now() + make_interval(secs => :lease_seconds),
           last_sequence = GREATEST(r.last_sequence, p.last_sequence),
           output_tokens = GREATEST(r.output_tokens, p.output_tokens)
      FROM unnest(CAST(:ids AS uuid[]), CAST(:sequences AS bigint[]), CAST(:tokens AS int[]))
           AS p(id, last_sequence, output_tokens)
     WHERE r.id = p.id AND r.lease_owner = :owner AND r.status IN ('QUEUED', 'RUNNING')
    RETURNING r.id, r.cancel_requested_at IS NOT NULL AS cancel_requested
    """
).bindparams(bindparam("lease_seconds", type_=Integer))


async def renew_leases(session: AsyncSession, owner: str, lease_seconds: float,
                       progress: Sequence[LeaseProgress]) -> list[LeaseState]:
    """One statement renews every lease this process holds and records durable progress.

    Runs missing from the result are no longer ours (a reaper ended them after our
    lease lapsed); their drivers must stop without writing anything.
    """
    if not progress:
        return []
    rows = await session.execute(
        _RENEW,
        {
            "lease_seconds": max(1, round(lease_seconds)),
            "ids": [p.run_id for p in progress],
            "sequences": [p.last_sequence for p in progress],
            "tokens": [p.output_tokens for p in progress],
            "owner": owner,
        },
    )
    return [LeaseState(run_id=str(row.id), cancel_requested=bool(row.cancel_requested)) for row in rows]


async def lock_own_active(session: AsyncSession, run_id: str, owner: str) -> Run | None:
    """The run, row-locked, if `owner` still holds its lease and it is not terminal yet."""
    return await session.scalar(
        select(Run)
        .where(Run.id == uuid.UUID(run_id), Run.lease_owner == owner, Run.status.in_(ACTIVE_CLAIMED))
        .with_for_update()
    )


async def take_expired_leases(session: AsyncSession, owner: str, lease_seconds: float,
                              limit: int) -> list[Run]:
    """Active runs whose driver stopped renewing; the reaper leases them to itself first
    so that two reapers never end the same run concurrently."""
    expired = (
        await session.scalars(
            select(Run)
            .where(Run.status.in_(ACTIVE_CLAIMED), Run.lease_expires_at < func.now())
            .order_by(Run.lease_expires_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
    ).all()
    await _lease_to(session, expired, owner, lease_seconds)
    return list(expired)


async def take_unpublished_terminals(session: AsyncSession, owner: str, lease_seconds: float,
                                     limit: int) -> list[Run]:
    """Terminal runs whose TERMINAL event was never confirmed published, once the lease of
    whoever settled them has lapsed (it may still be publishing until then)."""
    runs = (
        await session.scalars(
            select(Run)
            .where(and_(Run.terminal_published.is_(False), Run.terminal_sequence.is_not(None),
                        Run.lease_expires_at < func.now()))
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
    ).all()
    await _lease_to(session, runs, owner, lease_seconds)
    return list(runs)


async def _lease_to(session: AsyncSession, runs: Sequence[Run], owner: str, lease_seconds: float) -> None:
    """Lease the row-locked `runs` to `owner`. The loaded objects keep their previous lease_owner
    (synchronize_session=False): the reaper reports whose lease lapsed from them."""
    if runs:
        await session.execute(
            update(Run)
            .where(Run.id.in_([run.id for run in runs]))
            .values(lease_owner=owner, lease_expires_at=lease_until(lease_seconds))
            .execution_options(synchronize_session=False)
        )


async def in_flight_by_replica(session: AsyncSession) -> dict[str, int]:
    rows = await session.execute(
        select(Run.replica, func.count()).where(Run.status.in_(ACTIVE_CLAIMED)).group_by(Run.replica)
    )
    return {str(name): int(count) for name, count in rows if name is not None}
