"""Settle a run exactly once, inside the caller's transaction.

    settled = await settle_run(session, run_id, RunStatus.COMPLETED, output_tokens=40,
                               cached_input_tokens=0, detail=None)
    await session.commit()

The guard is `usage_entries.run_id UNIQUE`: the usage entry is inserted first with
ON CONFLICT (run_id) DO NOTHING, and only the transaction whose insert took effect goes on to
finish the run and move its reservation to `used_*`. A concurrent second settler blocks on the
unique index until the first commits, then inserts nothing and returns False, touching nothing.
If the caller's transaction rolls back, the whole settlement (entry, status, budget) goes with it.

What is charged: the prompt when the run reached a replica (its `replica` is set; a run cancelled
while still ACCEPTED consumed nothing), cached prompt tokens at the cached rate, and the output
tokens reported. Counts are bounded by the reservation, so `used` never exceeds what was held.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass

from sluice.ledger.models import TERMINAL_STATUSES, Model, PriceCard, Run, RunStatus, UsageEntry
from sluice.ledger.pricing import PriceCard as PriceCardRates
from sluice.ledger.pricing import cost_micros
from sluice.ledger.repositories import BudgetRepository
from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession


class SettlementError(ValueError):
    """settle_run was called with values no run could have produced (a caller bug)."""


@dataclass(frozen=True, slots=True)
class SettledUsage:
    run_id: uuid.UUID
    status: RunStatus
    input_tokens: int                # prompt tokens charged (0 if the run never reached a replica)
    cached_input_tokens: int         # of which served from the prefix cache
    output_tokens: int
    cost_micros: int
    settled_at: dt.datetime


async def settle_run(
    session: AsyncSession,
    run_id: uuid.UUID | str,
    status: RunStatus | str,
    output_tokens: int,
    cached_input_tokens: int,
    detail: str | None,
    *,
    input_tokens: int | None = None,
) -> bool:
    """Finish the run in `status` and settle its usage; False (and no change) if already settled.

    `input_tokens` overrides the charged prompt size; by default it is the whole prompt when the
    run was handed to a replica and 0 when it never was.
    """
    settled = await settle_run_usage(session, run_id, status, output_tokens, cached_input_tokens, detail,
                                     input_tokens=input_tokens)
    return settled is not None


async def settle_run_usage(
    session: AsyncSession,
    run_id: uuid.UUID | str,
    status: RunStatus | str,
    output_tokens: int,
    cached_input_tokens: int,
    detail: str | None,
    *,
    input_tokens: int | None = None,
) -> SettledUsage | None:
    """settle_run, returning the settlement it made (what `settled_usage` would read back), or
    None if the run was already settled."""
    run_uuid = uuid.UUID(str(run_id))
    final = RunStatus(status)
    if final not in TERMINAL_STATUSES:
        raise SettlementError(f"settle_run needs a terminal status, got {final.value}")

    run = await session.scalar(select(Run).where(Run.id == run_uuid))
    if run is None:
        raise SettlementError(f"no run {run_uuid}")
    card = await price_card_of(session, run)

    if input_tokens is None:
        input_tokens = run.input_tokens if run.replica is not None else 0
    charged_input = input_tokens
    _check_counts(run, charged_input, cached_input_tokens, output_tokens)
    cost = cost_micros(card, charged_input, cached_input_tokens, output_tokens)

    inserted = await session.execute(
        pg_insert(UsageEntry)
        .values(
            id=uuid.uuid4(),
            run_id=run.id,
            tenant_id=run.tenant_id,
            model_version=run.model_version,
            day=func.date(func.timezone("UTC", func.now())),
            input_tokens=charged_input,
            cached_input_tokens=cached_input_tokens,
            output_tokens=output_tokens,
            cost_micros=cost,
            api_key_id=run.api_key_id,
            price_card_id=run.price_card_id,
            route_reason=run.route_reason,
            worker_pool=run.worker_pool,
            quality_tier=run.quality_tier,
        )
        .on_conflict_do_nothing(index_elements=[UsageEntry.run_id])
        .returning(UsageEntry.settled_at)
    )
    settled_at = inserted.scalar_one_or_none()
    if settled_at is None:
        return None

    await session.execute(
        update(Run)
        .where(Run.id == run.id)
        .values(
            status=final.value,
            finished_at=func.now(),
            output_tokens=output_tokens,
            cached_input_tokens=cached_input_tokens,
            detail=detail,
        )
        .execution_options(synchronize_session=False)
    )
    await BudgetRepository(session).settle(
        run.tenant_id,
        run.created_at,
        released_tokens=run.reserved_tokens,
        released_cost_micros=run.reserved_cost_micros,
        used_tokens=charged_input + output_tokens,
        used_cost_micros=cost,
    )
    return SettledUsage(run_id=run.id, status=final, input_tokens=charged_input,
                        cached_input_tokens=cached_input_tokens, output_tokens=output_tokens,
                        cost_micros=cost, settled_at=settled_at)


async def price_card_of(session: AsyncSession, run: Run) -> PriceCardRates:
    """The prices a run settles at: the card admission reserved it at (price changes made since
    apply only to runs admitted after them), or, for a run without one, its model's prices."""
    if run.price_card_id is not None:
        card = await session.get(PriceCard, run.price_card_id)
        assert card is not None, f"run {run.id} names price card {run.price_card_id} that does not exist"
        return card
    model = await session.get(Model, run.model_version)
    assert model is not None, f"run {run.id} names model {run.model_version} that does not exist"
    return model


def _check_counts(run: Run, input_tokens: int, cached_input_tokens: int, output_tokens: int) -> None:
    if not 0 <= input_tokens <= run.input_tokens:
        raise SettlementError(f"input_tokens {input_tokens} outside 0..{run.input_tokens} for run {run.id}")
    if not 0 <= cached_input_tokens <= input_tokens:
        raise SettlementError(
            f"cached_input_tokens {cached_input_tokens} outside 0..{input_tokens} for run {run.id}"
        )
    if not 0 <= output_tokens <= run.max_output_tokens:
        raise SettlementError(
            f"output_tokens {output_tokens} outside 0..{run.max_output_tokens} (the run's cap)"
            f" for run {run.id}"
        )


async def settled_usage(session: AsyncSession, run_id: uuid.UUID | str) -> SettledUsage | None:
    """The run's settlement, if it has one (e.g. to put usage into the TERMINAL event)."""
    row = (
        await session.execute(
            select(UsageEntry, Run.status)
            .join(Run, Run.id == UsageEntry.run_id)
            .where(UsageEntry.run_id == uuid.UUID(str(run_id)))
        )
    ).one_or_none()
    if row is None:
        return None
    entry, status = row
    return SettledUsage(
        run_id=entry.run_id,
        status=RunStatus(status),
        input_tokens=entry.input_tokens,
        cached_input_tokens=entry.cached_input_tokens,
        output_tokens=entry.output_tokens,
        cost_micros=entry.cost_micros,
        settled_at=entry.settled_at,
    )
