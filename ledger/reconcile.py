"""Reconcile one budget period from the ledger alone: every check is a query over runs,
usage_entries, budgets and price_cards, and each row it returns is a named discrepancy.

A period is a UTC month of ADMISSION (runs.created_at), the same rule settlement uses to pick the
budget row it releases from, so the sums below are over exactly the runs that row accounted for:

    terminal_run_without_usage   a terminal run with no usage entry (a lost settlement)
    usage_of_unfinished_run      an entry whose run is not terminal (settled but still running)
    usage_cost                   entry.cost_micros != the cost of its tokens at the run's price card
                                 (the card admission reserved at; the model's prices for runs
                                 admitted before cards existed)
    budget_used_tokens           budgets.used_tokens != sum(input + output) of the period's entries
    budget_used_cost             budgets.used_cost_micros != sum(cost) of the period's entries
    budget_reserved_tokens       budgets.reserved_tokens != sum(reserved) of the period's runs in flight
    budget_reserved_cost         the same in micro-USD

"Exactly one" entry per terminal run: the zero case is the first check; more than one cannot be
written (usage_entries.run_id is UNIQUE). Run it in one REPEATABLE READ transaction so that a run
settling meanwhile is seen on one side of every check.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from sluice.ledger.models import (
    ACTIVE_STATUSES,
    TERMINAL_STATUSES,
    Budget,
    Model,
    PriceCard,
    Run,
    Tenant,
    UsageEntry,
)
from sluice.ledger.pricing import cost_micros_sql
from sluice.ledger.repositories import period_start_of
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased


@dataclass(frozen=True, slots=True)
class Discrepancy:
    check: str  # one of the names in the module docstring
    subject: str  # "run <id>", "usage entry of run <id>", "budget <tenant> <YYYY-MM>"
    expected: int | str
    actual: int | str

    @property
    def detail(self) -> str:
        return f"{self.check}: {self.subject}: expected {self.expected}, found {self.actual}"


@dataclass(frozen=True, slots=True)
class Reconciliation:
    period_start: dt.date
    runs_checked: int
    entries_checked: int
    budgets_checked: int
    discrepancies: tuple[Discrepancy, ...]

    @property
    def ok(self) -> bool:
        return not self.discrepancies


_TERMINAL = [s.value for s in TERMINAL_STATUSES]
_ACTIVE = [s.value for s in ACTIVE_STATUSES]


async def reconcile(session: AsyncSession, period_start: dt.date) -> Reconciliation:
    in_period = period_start_of(Run.created_at) == period_start
    found: list[Discrepancy] = []
    found += await _terminal_runs_without_usage(session, in_period)
    found += await _usage_of_unfinished_runs(session, in_period)
    found += await _wrong_costs(session, in_period)
    budgets = await _budget_mismatches(session, period_start, in_period)
    found += budgets[1]
    runs = await session.scalar(select(func.count()).select_from(Run).where(in_period))
    entries = await session.scalar(
        select(func.count()).select_from(UsageEntry).join(Run, Run.id == UsageEntry.run_id).where(in_period)
    )
    return Reconciliation(
        period_start=period_start,
        runs_checked=int(runs or 0),
        entries_checked=int(entries or 0),
        budgets_checked=budgets[0],
        discrepancies=tuple(found),
    )


async def _terminal_runs_without_usage(session: AsyncSession, in_period: Any) -> list[Discrepancy]:
    rows = await session.execute(
        select(Run.id, Run.status)
        .outerjoin(UsageEntry, UsageEntry.run_id == Run.id)
        .where(in_period, Run.status.in_(_TERMINAL), UsageEntry.id.is_(None))
        .order_by(Run.created_at)
    )
    return [
        Discrepancy("terminal_run_without_usage", f"run {run_id} ({status})", 1, 0) for run_id, status in rows
    ]


async def _usage_of_unfinished_runs(session: AsyncSession, in_period: Any) -> list[Discrepancy]:
    rows = await session.execute(
        select(Run.id, Run.status)
        .join(UsageEntry, UsageEntry.run_id == Run.id)
        .where(in_period, Run.status.in_(_ACTIVE))
        .order_by(Run.created_at)
    )
    return [
        Discrepancy("usage_of_unfinished_run", f"run {run_id}", "a terminal status", status)
        for run_id, status in rows
    ]


async def _wrong_costs(session: AsyncSession, in_period: Any) -> list[Discrepancy]:
    card = aliased(PriceCard)
    # The run's pinned card, else its model's own prices (runs admitted before cards existed).
    prices = (
        select(
            Run.id.label("run_id"),
            func.coalesce(card.price_input_per_m_micros, Model.price_input_per_m_micros).label(
                "price_input_per_m_micros"
            ),
            func.coalesce(card.price_cached_input_per_m_micros, Model.price_cached_input_per_m_micros).label(
                "price_cached_input_per_m_micros"
            ),
            func.coalesce(card.price_output_per_m_micros, Model.price_output_per_m_micros).label(
                "price_output_per_m_micros"
            ),
        )
        .join(Model, Model.version == Run.model_version)
        .outerjoin(card, card.id == Run.price_card_id)
        .where(in_period)
        .subquery()
    )
    expected = cost_micros_sql(
        UsageEntry.input_tokens, UsageEntry.cached_input_tokens, UsageEntry.output_tokens, prices.c
    )
    rows = await session.execute(
        select(UsageEntry.run_id, expected, UsageEntry.cost_micros)
        .join(prices, prices.c.run_id == UsageEntry.run_id)
        .where(expected != UsageEntry.cost_micros)
        .order_by(UsageEntry.run_id)
    )
    return [
        Discrepancy("usage_cost", f"usage entry of run {run_id}", int(want), int(got))
        for run_id, want, got in rows
    ]


async def _budget_mismatches(
    session: AsyncSession, period_start: dt.date, in_period: Any
) -> tuple[int, list[Discrepancy]]:
    settled = (
        select(
            Run.tenant_id,
            func.sum(UsageEntry.input_tokens + UsageEntry.output_tokens).label("tokens"),
            func.sum(UsageEntry.cost_micros).label("cost"),
        )
        .join(UsageEntry, UsageEntry.run_id == Run.id)
        .where(in_period)
        .group_by(Run.tenant_id)
        .subquery()
    )
    held = (
        select(
            Run.tenant_id,
            func.sum(Run.reserved_tokens).label("tokens"),
            func.sum(Run.reserved_cost_micros).label("cost"),
        )
        .where(in_period, Run.status.in_(_ACTIVE))
        .group_by(Run.tenant_id)
        .subquery()
    )
    rows = (
        await session.execute(
            select(
                Tenant.name,
                Budget.used_tokens,
                Budget.used_cost_micros,
                Budget.reserved_tokens,
                Budget.reserved_cost_micros,
                func.coalesce(settled.c.tokens, 0),
                func.coalesce(settled.c.cost, 0),
                func.coalesce(held.c.tokens, 0),
                func.coalesce(held.c.cost, 0),
            )
            .join(Tenant, Tenant.id == Budget.tenant_id)
            .outerjoin(settled, settled.c.tenant_id == Budget.tenant_id)
            .outerjoin(held, held.c.tenant_id == Budget.tenant_id)
            .where(Budget.period_start == period_start)
            .order_by(Tenant.name)
        )
    ).all()
    found = []
    for (
        name,
        used,
        used_cost,
        reserved,
        reserved_cost,
        want_used,
        want_cost,
        want_reserved,
        want_rcost,
    ) in rows:
        subject = f"budget {name} {period_start:%Y-%m}"
        for check, want, got in (
            ("budget_used_tokens", want_used, used),
            ("budget_used_cost", want_cost, used_cost),
            ("budget_reserved_tokens", want_reserved, reserved),
            ("budget_reserved_cost", want_rcost, reserved_cost),
        ):
            if int(want) != int(got):
                found.append(Discrepancy(check, subject, int(want), int(got)))
    return len(rows), found
