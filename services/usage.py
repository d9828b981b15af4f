"""UsageService.GetUsage: the caller's settled usage, kept apart from reservations in flight.

Settled rows come only from usage_entries (one per terminal run, written by settlement), grouped
by model version and UTC day of settlement. In flight is the sum of the reservations of the
tenant's runs that are not terminal yet: held against the budget, not billed. The budget shown is
the current period's (the UTC month of today on the database clock).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import grpc.aio
from sluice.ledger.models import UsageEntry
from sluice.ledger.reconcile import Reconciliation
from sluice.ledger.repositories import BudgetRepository, InFlightTotals, RunRepository
from sluice.services.auth import Metadata, authenticate
from sluice.services.errors import BAD_DATE, DATE_RANGE_REVERSED, InvalidArgument, grpc_errors
from sluice.services.finance import FinanceService, UsagePage
from sluice.services.validation import FieldLimits, add_checked_service
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import Settings
from sluice.v1 import common_pb2, usage_pb2, usage_pb2_grpc


@dataclass(frozen=True, slots=True)
class Totals:
    runs: int
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    cost_micros: int


@dataclass(frozen=True, slots=True)
class UsageRow:
    model_version: str
    day: dt.date                     # UTC day of settlement
    settled: Totals


@dataclass(frozen=True, slots=True)
class UsageReport:
    tenant: str
    from_date: dt.date
    to_date: dt.date
    rows: tuple[UsageRow, ...]       # ordered by day, then model version
    settled_total: Totals
    in_flight: InFlightTotals
    budget_tokens: int               # current period; 0 when the tenant has no budget row
    budget_cost_micros: int
    kv_token_budget: int = 0         # GPU-memory budget in KV tokens; 0 = no cap
    kv_tokens_held: int = 0          # what its claimed, unfinished runs hold now


def parse_date(field: str, value: str, default: dt.date) -> dt.date:
    if not value:
        return default
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise InvalidArgument(BAD_DATE.format(field=field, value=value)) from None


def report_window(from_date: str, to_date: str, today: dt.date) -> tuple[dt.date, dt.date]:
    """[from, to] inclusive; empty from = first of this month, empty to = today."""
    start = parse_date("from_date", from_date, today.replace(day=1))
    end = parse_date("to_date", to_date, today)
    if start > end:
        raise InvalidArgument(DATE_RANGE_REVERSED.format(start=start, end=end))
    return start, end


class UsageQueryService:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def report(self, metadata: Metadata, from_date: str, to_date: str) -> UsageReport:
        # One read-only transaction: REPEATABLE READ so rows, totals and in-flight sums come from
        # the same snapshot (a run settling mid-report is counted once, on one side).
        async with self._sessionmaker() as session, session.begin():
            await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
            tenant = await authenticate(session, metadata)
            today = await session.scalar(select(func.date(func.timezone("UTC", func.now()))))
            assert today is not None
            start, end = report_window(from_date, to_date, today)
            rows = await _settled_rows(session, tenant.id, start, end)
            in_flight = await RunRepository(session).in_flight_totals(tenant.id)
            held = await RunRepository(session).kv_tokens_held(tenant.id)
            budget = await BudgetRepository(session).current(tenant.id)
        return UsageReport(
            tenant=tenant.name,
            from_date=start,
            to_date=end,
            rows=rows,
            settled_total=_sum(row.settled for row in rows),
            in_flight=in_flight,
            budget_tokens=budget.token_budget if budget else 0,
            budget_cost_micros=budget.cost_budget_micros if budget else 0,
            kv_token_budget=tenant.kv_token_budget or 0,
            kv_tokens_held=held,
        )


async def _settled_rows(session: AsyncSession, tenant_id: uuid.UUID, start: dt.date,
                        end: dt.date) -> tuple[UsageRow, ...]:
    result = await session.execute(
        select(
            UsageEntry.model_version,
            UsageEntry.day,
            func.count(),
            func.sum(UsageEntry.input_tokens),
            func.sum(UsageEntry.cached_input_tokens),
            func.sum(UsageEntry.output_tokens),
            func.sum(UsageEntry.cost_micros),
        )
        .where(UsageEntry.tenant_id == tenant_id, UsageEntry.day.between(start, end))
        .group_by(UsageEntry.model_version, UsageEntry.day)
        .order_by(UsageEntry.day, UsageEntry.model_version)
    )
    return tuple(
        UsageRow(
            model_version=version,
            day=day,
            settled=Totals(int(runs), int(inputs), int(cached), int(outputs), int(cost)),
        )
        for version, day, runs, inputs, cached, outputs, cost in result.all()
    )


def _sum(totals: Iterable[Totals]) -> Totals:
    items = list(totals)
    return Totals(
        runs=sum(t.runs for t in items),
        input_tokens=sum(t.input_tokens for t in items),
        cached_input_tokens=sum(t.cached_input_tokens for t in items),
        output_tokens=sum(t.output_tokens for t in items),
        cost_micros=sum(t.cost_micros for t in items),
    )


# --- gRPC edge ------------------------------------------------------------------------------------


def _token_usage(totals: Totals) -> common_pb2.TokenUsage:
    return common_pb2.TokenUsage(
        input_tokens=totals.input_tokens,
        cached_input_tokens=totals.cached_input_tokens,
        output_tokens=totals.output_tokens,
        cost_micros=totals.cost_micros,
    )


def report_to_proto(report: UsageReport) -> usage_pb2.GetUsageResponse:
    return usage_pb2.GetUsageResponse(
        tenant=report.tenant,
        rows=[
            usage_pb2.UsageRow(
                model_version=row.model_version,
                day=row.day.isoformat(),
                runs=row.settled.runs,
                settled=_token_usage(row.settled),
            )
            for row in report.rows
        ],
        settled_total=_token_usage(report.settled_total),
        in_flight=_in_flight(report.in_flight),
        budget_tokens=report.budget_tokens,
        budget_cost_micros=report.budget_cost_micros,
        kv_token_budget=report.kv_token_budget,
        kv_tokens_held=report.kv_tokens_held,
    )


def _in_flight(totals: InFlightTotals) -> usage_pb2.InFlight:
    return usage_pb2.InFlight(runs=totals.runs, reserved_tokens=totals.reserved_tokens,
                              reserved_cost_micros=totals.reserved_cost_micros)


def page_to_proto(page: UsagePage) -> usage_pb2.QueryUsageResponse:
    return usage_pb2.QueryUsageResponse(
        groups=[
            usage_pb2.UsageGroup(
                tenant=group.tenant or "", api_key=group.api_key or "",
                model_version=group.model_version or "",
                route=group.route or "", pool=group.pool or "", tier=group.tier or "",
                bucket_start=group.bucket_start.astimezone(dt.UTC).isoformat() if group.bucket_start else "",
                runs=group.runs,
                settled=_token_usage(Totals(group.runs, group.input_tokens, group.cached_input_tokens,
                                            group.output_tokens, group.cost_micros)),
            )
            for group in page.groups
        ],
        next_page_token=page.next_page_token,
        in_flight=_in_flight(page.in_flight),
    )


def reconciliation_to_proto(result: Reconciliation) -> usage_pb2.ReconcileResponse:
    return usage_pb2.ReconcileResponse(
        period=f"{result.period_start:%Y-%m}", runs_checked=result.runs_checked,
        entries_checked=result.entries_checked, budgets_checked=result.budgets_checked,
        discrepancies=[usage_pb2.Discrepancy(check=d.check, subject=d.subject, expected=str(d.expected),
                                             actual=str(d.actual), detail=d.detail)
                       for d in result.discrepancies])


class UsageServicer(usage_pb2_grpc.UsageServiceServicer):
    def __init__(self, service: UsageQueryService, finance: FinanceService) -> None:
        self._service = service
        self._finance = finance

    @grpc_errors
    async def GetUsage(
        self, request: usage_pb2.GetUsageRequest, context: grpc.aio.ServicerContext
    ) -> usage_pb2.GetUsageResponse:
        report = await self._service.report(context.invocation_metadata(), request.from_date, request.to_date)
        return report_to_proto(report)

    @grpc_errors
    async def QueryUsage(
        self, request: usage_pb2.QueryUsageRequest, context: grpc.aio.ServicerContext
    ) -> usage_pb2.QueryUsageResponse:
        page = await self._finance.query(
            context.invocation_metadata(), getattr(request, "from"), request.to, list(request.group_by),
            request.bucket, request.tenant, request.page_size, request.page_token)
        return page_to_proto(page)

    @grpc_errors
    async def Reconcile(
        self, request: usage_pb2.ReconcileRequest, context: grpc.aio.ServicerContext
    ) -> usage_pb2.ReconcileResponse:
        result = await self._finance.reconcile(context.invocation_metadata(), request.period)
        return reconciliation_to_proto(result)


def add_usage_servicer(server: grpc.aio.Server, sessionmaker: async_sessionmaker[AsyncSession],
                       config: Settings) -> UsageQueryService:
    """Register UsageService on `server`; `config` gives the edge's field limits."""
    service = UsageQueryService(sessionmaker)
    servicer = UsageServicer(service, FinanceService(sessionmaker))
    add_checked_service(server, usage_pb2.DESCRIPTOR.services_by_name["UsageService"], servicer,
                        FieldLimits.from_config(config))
    return service
