"""Settlement exactly once and the usage report (settled kept apart from in flight), on real PostgreSQL."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import pytest
from sluice.ledger.models import Model, Run, RunStatus, UsageEntry
from sluice.ledger.pricing import cost_micros
from sluice.ledger.settlement import SettlementError, settle_run, settled_usage
from sluice.services import errors
from sqlalchemy import select, update

from sluice.v1 import usage_pb2
from tests.support.ledger_factories import (
    DEFAULT_MODEL,
    MICROS,
    ModelSpec,
    add_model,
    add_tenant,
    budget_row,
    count_usage_entries,
    get_run,
    prompt_of,
)

if TYPE_CHECKING:
    from tests.support.ledger_factories import TenantHandle
    from tests.support.ledger_services import Services

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]
pytestmark = pytest.mark.integration


async def setup(api: Services, name: str = "acme") -> TenantHandle:
    async with api.sessionmaker() as session, session.begin():
        if await session.get(Model, DEFAULT_MODEL.version) is None:
            await add_model(session, api.tokenizer)
        return await add_tenant(session, name)


async def admit_on_replica(api: Services, tenant: TenantHandle, prompt_tokens: int, cap: int) -> uuid.UUID:
    """Submit, then do what a routing worker does before driving it: record the replica."""
    response = await api.submit(tenant, prompt_of(prompt_tokens), cap)
    run_id = uuid.UUID(response.run_id)
    async with api.sessionmaker() as session, session.begin():
        await session.execute(
            update(Run).where(Run.id == run_id).values(status=RunStatus.QUEUED.value, replica="r0")
        )
    return run_id


async def settle(api: Services, run_id: uuid.UUID, status: RunStatus, output_tokens: int,
                 cached_input_tokens: int = 0, detail: str | None = None) -> bool:
    async with api.sessionmaker() as session, session.begin():
        return await settle_run(session, run_id, status, output_tokens, cached_input_tokens, detail)


# --- settlement ----------------------------------------------------------------------------------


async def test_settling_charges_what_was_consumed_at_the_price_card_and_releases_the_reservation(api):
    tenant = await setup(api)
    run_id = await admit_on_replica(api, tenant, prompt_tokens=1_000, cap=500)
    held = await budget_row(api.sessionmaker, tenant.id)
    assert (held.reserved_tokens, held.reserved_cost_micros) == (1_500, 1_250)  # 500 + 750 micros

    settled = await settle(api, run_id, RunStatus.COMPLETED, output_tokens=200, cached_input_tokens=400)

    assert settled is True
    # 600 uncached × $0.50/M + 400 cached × $0.05/M + 200 out × $1.50/M = 300 + 20 + 300 micros
    expected_cost = 620
    assert cost_micros(DEFAULT_MODEL, 1_000, 400, 200) == expected_cost
    budget = await budget_row(api.sessionmaker, tenant.id)
    assert (budget.reserved_tokens, budget.used_tokens) == (0, 1_200)
    assert (budget.reserved_cost_micros, budget.used_cost_micros) == (0, expected_cost)
    run = await get_run(api.sessionmaker, run_id)
    assert (run.status, run.output_tokens, run.cached_input_tokens) == ("COMPLETED", 200, 400)
    assert run.finished_at is not None
    async with api.sessionmaker() as session:
        usage = await settled_usage(session, run_id)
    assert usage is not None
    assert usage.status == RunStatus.COMPLETED
    assert (usage.input_tokens, usage.cached_input_tokens, usage.output_tokens) == (1_000, 400, 200)
    assert usage.cost_micros == expected_cost


async def test_settling_twice_is_a_no_op_the_second_time(api):
    tenant = await setup(api)
    run_id = await admit_on_replica(api, tenant, prompt_tokens=100, cap=100)
    assert await settle(api, run_id, RunStatus.COMPLETED, output_tokens=40)
    after_first = await budget_row(api.sessionmaker, tenant.id)

    again = await settle(api, run_id, RunStatus.INTERRUPTED, output_tokens=99, detail="late reaper")

    assert again is False
    assert await budget_row(api.sessionmaker, tenant.id) == after_first
    run = await get_run(api.sessionmaker, run_id)
    assert (run.status, run.output_tokens, run.detail) == ("COMPLETED", 40, None)
    assert await count_usage_entries(api.sessionmaker, run_id) == 1


async def test_concurrent_settlements_of_one_run_charge_it_once(api):
    tenant = await setup(api)
    run_id = await admit_on_replica(api, tenant, prompt_tokens=100, cap=100)

    results = await asyncio.gather(
        *(settle(api, run_id, RunStatus.COMPLETED, output_tokens=10 + i) for i in range(8))
    )

    assert sorted(results) == [False] * 7 + [True]
    budget = await budget_row(api.sessionmaker, tenant.id)
    run = await get_run(api.sessionmaker, run_id)
    assert (budget.reserved_tokens, budget.used_tokens) == (0, 100 + run.output_tokens)
    assert await count_usage_entries(api.sessionmaker, run_id) == 1


async def test_a_run_cancelled_before_reaching_a_replica_costs_nothing(api):
    tenant = await setup(api)
    response = await api.submit(tenant, prompt_of(100), 100)

    assert await settle(api, uuid.UUID(response.run_id), RunStatus.CANCELLED, output_tokens=0)

    budget = await budget_row(api.sessionmaker, tenant.id)
    assert (budget.reserved_tokens, budget.used_tokens) == (0, 0)
    assert (budget.reserved_cost_micros, budget.used_cost_micros) == (0, 0)


@pytest.mark.parametrize(
    ("status", "output_tokens", "cached", "message"),
    [
        (RunStatus.RUNNING, 1, 0, "settle_run needs a terminal status, got RUNNING"),
        (RunStatus.COMPLETED, 101, 0, "output_tokens 101 outside 0..100 (the run's cap)"),
        (RunStatus.COMPLETED, 1, 101, "cached_input_tokens 101 outside 0..100"),
    ],
)
async def test_impossible_settlements_raise_and_write_nothing(api, status, output_tokens, cached, message):
    tenant = await setup(api)
    run_id = await admit_on_replica(api, tenant, prompt_tokens=100, cap=100)
    before = await budget_row(api.sessionmaker, tenant.id)

    with pytest.raises(SettlementError, match=message.replace("(", r"\(").replace(")", r"\)")):
        await settle(api, run_id, status, output_tokens, cached)

    assert await budget_row(api.sessionmaker, tenant.id) == before
    assert await count_usage_entries(api.sessionmaker, run_id) == 0


# --- usage report --------------------------------------------------------------------------------


async def test_the_usage_report_keeps_settled_usage_apart_from_reservations_in_flight(api):
    tenant = await setup(api)
    async with api.sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, ModelSpec(version="test-model-v2", alias="test2"))
    done = await admit_on_replica(api, tenant, prompt_tokens=100, cap=50)
    also_done = await admit_on_replica(api, tenant, prompt_tokens=10, cap=50)
    in_flight = await api.submit(tenant, prompt_of(30), 20)
    other_model = await api.submit(tenant, prompt_of(5), 5, model="test2")
    await settle(api, done, RunStatus.COMPLETED, output_tokens=50)
    await settle(api, also_done, RunStatus.INTERRUPTED, output_tokens=7)
    await settle(api, uuid.UUID(other_model.run_id), RunStatus.CANCELLED, output_tokens=0)

    report = await api.usage_report(tenant)

    today = dt.datetime.now(dt.UTC).date().isoformat()
    assert report.tenant == "acme"
    assert [(r.model_version, r.day, r.runs) for r in report.rows] == [
        ("test-model-v1", today, 2),
        ("test-model-v2", today, 1),
    ]
    v1 = report.rows[0].settled
    assert (v1.input_tokens, v1.cached_input_tokens, v1.output_tokens) == (110, 0, 57)
    assert v1.cost_micros == cost_micros(DEFAULT_MODEL, 100, 0, 50) + cost_micros(DEFAULT_MODEL, 10, 0, 7)
    assert (report.settled_total.input_tokens, report.settled_total.output_tokens) == (110, 57)
    assert report.settled_total.cost_micros == v1.cost_micros
    held = await get_run(api.sessionmaker, in_flight.run_id)
    assert (report.in_flight.runs, report.in_flight.reserved_tokens) == (1, 50)
    assert report.in_flight.reserved_cost_micros == held.reserved_cost_micros
    assert (report.budget_tokens, report.budget_cost_micros) == (1_000_000, 1_000 * MICROS)


async def test_the_usage_report_shows_only_the_callers_tenant(api):
    tenant = await setup(api)
    other = await setup(api, "other")
    run_id = await admit_on_replica(api, tenant, prompt_tokens=10, cap=10)
    await settle(api, run_id, RunStatus.COMPLETED, output_tokens=10)
    await api.submit(tenant, prompt_of(10), 10)

    report = await api.usage_report(other)

    assert report.tenant == "other"
    assert list(report.rows) == []
    assert report.settled_total.input_tokens == 0
    assert (report.in_flight.runs, report.in_flight.reserved_tokens) == (0, 0)


async def test_the_usage_report_covers_exactly_the_requested_days(api):
    tenant = await setup(api)
    january = await admit_on_replica(api, tenant, 10, 10)
    today_run = await admit_on_replica(api, tenant, 10, 10)
    await settle(api, january, RunStatus.COMPLETED, output_tokens=1)
    await settle(api, today_run, RunStatus.COMPLETED, output_tokens=2)
    async with api.sessionmaker() as session, session.begin():
        await session.execute(
            update(UsageEntry).where(UsageEntry.run_id == january).values(day=dt.date(2026, 1, 31))
        )

    this_month = await api.usage_report(tenant)
    only_january = await api.usage_report(tenant, "2026-01-31", "2026-01-31")
    february = await api.usage_report(tenant, "2026-02-01", "2026-02-28")

    assert [r.settled.output_tokens for r in this_month.rows] == [2]
    assert [(r.day, r.settled.output_tokens) for r in only_january.rows] == [("2026-01-31", 1)]
    assert list(february.rows) == []


@pytest.mark.parametrize(
    ("from_date", "to_date", "message"),
    [
        ("2026-13-01", "", errors.BAD_DATE.format(field="from_date", value="2026-13-01")),
        ("", "yesterday", errors.BAD_DATE.format(field="to_date", value="yesterday")),
        ("2026-03-02", "2026-03-01", errors.DATE_RANGE_REVERSED.format(start="2026-03-02", end="2026-03-01")),
    ],
)
async def test_malformed_report_dates_are_invalid_argument(api, from_date, to_date, message):
    tenant = await setup(api)

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.usage_report(tenant, from_date, to_date)

    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


async def test_the_usage_report_needs_a_valid_key(api):
    await setup(api)

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.usage.GetUsage(usage_pb2.GetUsageRequest(), metadata=(("x-api-key", "sk-wrong"),))

    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert caught.value.details() == errors.UNKNOWN_API_KEY


async def test_settled_usage_is_none_for_an_unsettled_run(api):
    tenant = await setup(api)
    response = await api.submit(tenant, "alpha", 5)

    async with api.sessionmaker() as session:
        assert await settled_usage(session, response.run_id) is None
        assert (await session.scalars(select(UsageEntry))).all() == []
