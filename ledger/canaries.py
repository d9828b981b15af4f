"""Canaries in the ledger (table canaries): what the Admin API starts, moves and ends, and what the
guard (services/canary_guard.py) reads and rolls back.

Admission never reads this module: its one SELECT joins the table itself (ledger/admission_sql.py),
so a rollback committed here takes effect on the very next Submit of every gateway.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from sluice.ledger.models import Canary, CanaryState, Model, Run, RunStatus
from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from sluice.traffic.canary import Guardrails, RunSample

FAILED_STATUSES = (RunStatus.FAILED.value, RunStatus.INTERRUPTED.value)
# Runs that say nothing about the model: the caller cancelled, or the deadline passed in the queue.
_JUDGED_STATUSES = (RunStatus.COMPLETED.value, *FAILED_STATUSES)


@dataclass(frozen=True, slots=True)
class CanaryRecord:
    alias: str
    baseline_version: str
    candidate_version: str
    share_bp: int
    state: CanaryState
    guardrails: Guardrails
    started_at: dt.datetime
    ended_at: dt.datetime | None
    reason: str | None               # why it ended
    last_judgment: dict[str, Any] | None
    judged_at: dt.datetime | None

    @classmethod
    def of(cls, row: Canary) -> CanaryRecord:
        return cls(alias=row.alias, baseline_version=row.baseline_version,
                   candidate_version=row.candidate_version, share_bp=row.share_bp,
                   state=CanaryState(row.state), guardrails=guardrails_of(row),
                   started_at=row.started_at, ended_at=row.ended_at, reason=row.reason,
                   last_judgment=row.last_judgment, judged_at=row.judged_at)


def guardrails_of(row: Canary) -> Guardrails:
    return Guardrails(window_s=row.window_s, min_samples=row.min_samples,
                      max_ttft_ratio=row.max_ttft_ratio, max_tpot_ratio=row.max_tpot_ratio,
                      max_failure_rate_increase=row.max_failure_rate_increase)


class CanaryRepository:
    """Made from the caller's session; never commits."""

    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def get(self, alias: str, *, lock: bool = False) -> CanaryRecord | None:
        statement = select(Canary).where(Canary.alias == alias)
        if lock:
            statement = statement.with_for_update()
        row = await self._session.scalar(statement)
        return None if row is None else CanaryRecord.of(row)

    async def all(self) -> list[CanaryRecord]:
        rows = await self._session.scalars(select(Canary).order_by(Canary.alias))
        return [CanaryRecord.of(row) for row in rows]

    async def active(self) -> list[CanaryRecord]:
        rows = await self._session.scalars(
            select(Canary).where(Canary.state == CanaryState.ACTIVE.value).order_by(Canary.alias))
        return [CanaryRecord.of(row) for row in rows]

    async def start(self, alias: str, baseline: str, candidate: str, share_bp: int,
                    limits: Guardrails) -> None:
        """A new canary on `alias`, replacing an ended one (the caller checked none is active)."""
        await self._session.execute(delete(Canary).where(Canary.alias == alias))
        self._session.add(Canary(
            alias=alias, baseline_version=baseline, candidate_version=candidate, share_bp=share_bp,
            state=CanaryState.ACTIVE.value, window_s=limits.window_s, min_samples=limits.min_samples,
            max_ttft_ratio=limits.max_ttft_ratio, max_tpot_ratio=limits.max_tpot_ratio,
            max_failure_rate_increase=limits.max_failure_rate_increase))
        await self._session.flush()

    async def set_share(self, alias: str, share_bp: int) -> None:
        await self._update(alias, share_bp=share_bp)

    async def end(self, alias: str, state: CanaryState, reason: str) -> bool:
        """Share 0 and the reason, if it is still active; False when it had already ended (another
        guard or an admin got there first: the first reason stands)."""
        result = await self._session.execute(
            update(Canary)
            .where(Canary.alias == alias, Canary.state == CanaryState.ACTIVE.value)
            .values(state=state.value, share_bp=0, ended_at=func.now(), reason=reason)
            .execution_options(synchronize_session=False))
        return bool(result.rowcount)  # type: ignore[attr-defined]

    async def record_judgment(self, alias: str, judgment: dict[str, Any]) -> None:
        await self._update(alias, last_judgment=judgment, judged_at=func.now())

    async def _update(self, alias: str, **values: Any) -> None:
        await self._session.execute(update(Canary).where(Canary.alias == alias).values(**values)
                                    .execution_options(synchronize_session=False))

    async def samples(self, version: str, since: dt.datetime, window_s: float) -> list[RunSample]:
        """Runs of `version` admitted since `since` that finished within the last `window_s` (database
        clock), as guardrail samples. TTFT is started_at - created_at, what the caller waited; TPOT the
        decode time over the tokens after the first. Read by the model's claim times
        (ix_runs_model_version_queued_at): every run judged was claimed, at or after its admission."""
        rows = await self._session.execute(
            select(Run.status, Run.created_at, Run.started_at, Run.finished_at, Run.output_tokens)
            .where(Run.model_version == version, Run.created_at >= since, Run.queued_at >= since,
                   Run.status.in_(_JUDGED_STATUSES),
                   Run.finished_at >= func.now() - dt.timedelta(seconds=window_s)))
        samples = []
        for status, created, started, finished, tokens in rows:
            ttft = (started - created).total_seconds() if started is not None else None
            tpot = ((finished - started).total_seconds() / (tokens - 1)
                    if started is not None and finished is not None and tokens > 1 else None)
            samples.append(RunSample(ttft_s=ttft, tpot_s=tpot, failed=status in FAILED_STATUSES))
        return samples

    async def model(self, version: str) -> Model | None:
        return await self._session.get(Model, version)
