"""Priority classes, the GPU-memory budget and the degradation ladder at admission, on the real
PostgreSQL (issue 14 points 4-6). No routing worker: a run "claimed" is marked QUEUED by hand.

The tight config: at most 3 interactive runs may wait per model ([admission].max_backlog_per_pool),
so the ladder sheds batch from ceil(3 x 0.25) = 1 waiting, lets fallbacks in from ceil(3 x 0.5) = 2,
and sheds interactive at 3; at most 5 batch runs may wait; the configured drain is 10 runs/s.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
import pytest
from sluice.ledger.models import Run, RunStatus, Tenant
from sluice.services import errors
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import Settings, load_settings
from sluice.traffic.ladder import Step
from sluice.v1 import admin_pb2, common_pb2
from tests.support.ledger_factories import DEFAULT_MODEL, add_model, add_tenant, count_runs
from tests.support.ledger_services import serve_ledger

if TYPE_CHECKING:
    from tests.support.ledger_factories import TenantHandle
    from tests.support.ledger_services import Services

pytestmark = pytest.mark.integration

POOL = DEFAULT_MODEL.version
BATCH = common_pb2.PRIORITY_BATCH
DAY_MS = 86_400_000


def tight_config() -> Settings:
    return load_settings().updated(
        admission={"max_backlog_per_pool": 3, "pool_drain_runs_per_s": 10.0,
                   "expected_ms_per_prompt_token": 0.0, "expected_ms_per_output_token": 0.0},
        traffic={"max_batch_backlog_per_pool": 5, "drain_window_s": 10.0, "min_drained_to_measure": 10})


@pytest.fixture
async def tight(sessionmaker: async_sessionmaker[AsyncSession],
                word_tokenizer: str) -> AsyncIterator[Services]:
    async with serve_ledger(sessionmaker, word_tokenizer, tight_config()) as services:
        yield services


async def setup(api: Services, *, batch_allowed: bool = True, kv_token_budget: int | None = None
                ) -> TenantHandle:
    async with api.sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, DEFAULT_MODEL)
        tenant = await add_tenant(session, "acme")
        await session.execute(update(Tenant).where(Tenant.id == tenant.id).values(
            batch_allowed=batch_allowed, kv_token_budget=kv_token_budget))
        return tenant


async def refused(call: Any, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    return caught.value


def retry_after(error: grpc.aio.AioRpcError) -> str:
    return dict(error.trailing_metadata() or ())[errors.RETRY_AFTER_MS_KEY]


async def mark_claimed(api: Services, run_id: str) -> None:
    """A routing worker's claim: the run leaves ACCEPTED, claimed now."""
    async with api.sessionmaker() as session, session.begin():
        await session.execute(update(Run).where(Run.id == uuid.UUID(run_id)).values(
            status=RunStatus.QUEUED.value, queued_at=func.now()))


async def run_row(api: Services, run_id: str) -> Run:
    async with api.sessionmaker() as session:
        run = await session.get(Run, uuid.UUID(run_id))
        assert run is not None
        return run


# --- priority classes ----------------------------------------------------------------------------


async def test_a_batch_run_is_recorded_as_batch_with_the_six_hour_default_deadline(tight):
    tenant = await setup(tight)
    response = await tight.submit(tenant, "alpha", 5, priority=BATCH)
    run = await run_row(tight, response.run_id)
    assert response.priority == BATCH and run.priority == "batch"
    assert run.deadline_at - run.created_at == dt.timedelta(hours=6)   # [traffic].default_batch_deadline_ms
    interactive = await tight.submit(tenant, "alpha", 5)
    assert interactive.priority == common_pb2.PRIORITY_INTERACTIVE
    assert (await run_row(tight, interactive.run_id)).priority == "interactive"


async def test_batch_is_refused_to_a_tenant_not_permitted_it(tight):
    tenant = await setup(tight, batch_allowed=False)
    error = await refused(tight.submit(tenant, "alpha", 5, priority=BATCH), grpc.StatusCode.PERMISSION_DENIED)
    assert error.details() == errors.BATCH_NOT_ALLOWED
    assert await count_runs(tight.sessionmaker) == 0


async def test_batch_may_carry_a_two_day_deadline_where_interactive_may_not(tight):
    tenant = await setup(tight)
    two_days = 2 * DAY_MS
    batch = await tight.submit(tenant, "alpha", 5, priority=BATCH, deadline_ms=two_days)
    run = await run_row(tight, batch.run_id)
    assert run.deadline_at - run.created_at == dt.timedelta(days=2)
    error = await refused(tight.submit(tenant, "alpha", 5, deadline_ms=two_days),
                          grpc.StatusCode.INVALID_ARGUMENT)
    assert error.details() == errors.FIELD_ABOVE_RANGE.format(field="deadline_ms", high=DAY_MS,
                                                              value=two_days)
    four_days = 4 * DAY_MS   # past [traffic].max_batch_deadline_ms (three days): refused at the edge
    await refused(tight.submit(tenant, "alpha", 5, priority=BATCH, deadline_ms=four_days),
                  grpc.StatusCode.INVALID_ARGUMENT)


# --- the ladder at admission ---------------------------------------------------------------------


async def test_one_interactive_run_waiting_sheds_batch_but_not_interactive(tight):
    tenant = await setup(tight)
    await tight.submit(tenant, "alpha", 5, priority=BATCH)          # nothing interactive waits: admitted
    await tight.submit(tenant, "alpha", 5)                           # 1 interactive waiting

    error = await refused(tight.submit(tenant, "alpha", 5, priority=BATCH), grpc.StatusCode.UNAVAILABLE)

    # 1 waiting at the configured 10 runs/s (no claims measured): 100 ms.
    assert error.details() == errors.BATCH_SHED.format(model=POOL, backlog=1, pool=POOL, threshold=1,
                                                       retry_after_ms=100)
    assert retry_after(error) == "100"
    await tight.submit(tenant, "alpha", 5)                           # interactive still admitted (2 < 3)
    assert await count_runs(tight.sessionmaker) == 3
    assert tight.service is not None
    metrics = tight.service.ladder_metrics        # each step visible: the refusal counted, the step shown
    assert metrics.count(POOL, Step.SHED_BATCH) == 1
    # The last submit found 1 interactive run waiting: step 2 (shed batch), not yet 3 (fallbacks at 2).
    assert metrics.registry.get_sample_value("sluice_ladder_step", {"pool": POOL}) == Step.SHED_BATCH


async def test_batch_runs_have_their_own_backlog_and_never_count_against_interactive(tight):
    tenant = await setup(tight)
    for _ in range(5):
        await tight.submit(tenant, "alpha", 5, priority=BATCH)

    error = await refused(tight.submit(tenant, "alpha", 5, priority=BATCH), grpc.StatusCode.UNAVAILABLE)
    for _ in range(3):                                               # 5 batch waiting; interactive: 3 fit
        await tight.submit(tenant, "alpha", 5)

    # 5 batch waiting at 10 runs/s: 500 ms.
    assert error.details() == errors.BATCH_BACKLOG_FULL.format(model=POOL, backlog=5, pool=POOL, limit=5,
                                                               retry_after_ms=500)
    await refused(tight.submit(tenant, "alpha", 5), grpc.StatusCode.UNAVAILABLE)   # the 4th interactive


async def test_interactive_shedding_tells_the_retry_after_of_the_measured_drain_rate(tight):
    tenant = await setup(tight)
    for _ in range(10):     # ten runs claimed in the last 10 s: the pool drains 1 run/s, not 10
        await mark_claimed(tight, (await tight.submit(tenant, "alpha", 5)).run_id)
    for _ in range(3):
        await tight.submit(tenant, "alpha", 5)

    error = await refused(tight.submit(tenant, "alpha", 5), grpc.StatusCode.UNAVAILABLE)

    # 3 waiting / (10 claims / 10 s) = 3 s; the configured rate alone would have said 300 ms.
    assert error.details() == errors.POOL_BACKLOG_FULL.format(model=POOL, pool=POOL, backlog=3, limit=3,
                                                              retry_after_ms=3000)
    assert retry_after(error) == "3000"
    assert tight.service is not None and tight.service.ladder_metrics.count(POOL, Step.SHED_INTERACTIVE) == 1


# --- GPU-memory budget at admission --------------------------------------------------------------


async def test_a_run_larger_than_the_whole_kv_budget_is_refused_with_the_cap_that_fits(tight):
    tenant = await setup(tight)
    prompt = (await tight.submit(tenant, "alpha", 5)).input_tokens
    async with tight.sessionmaker() as session, session.begin():
        await session.execute(update(Tenant).where(Tenant.id == tenant.id).values(
            kv_token_budget=prompt + 5))

    await tight.submit(tenant, "alpha", 5)                  # prompt + 5 = the whole budget: admitted
    error = await refused(tight.submit(tenant, "alpha", 6), grpc.StatusCode.RESOURCE_EXHAUSTED)

    assert error.details() == errors.KV_BUDGET_NEVER_FITS.format(
        needed=prompt + 6, prompt=prompt, cap=6, budget=prompt + 5,
        advice=errors.CONTEXT_ADVICE_LOWER_CAP.format(fit=5))
    assert dict(error.trailing_metadata() or ())[errors.MAX_OUTPUT_TOKENS_THAT_FIT_KEY] == "5"
    assert await count_runs(tight.sessionmaker) == 2


# --- the Admin API sets both per tenant ----------------------------------------------------------


async def test_an_admin_sets_a_tenants_kv_budget_and_batch_permission_audited(gateway):
    admin, as_admin = gateway.admin, gateway.as_admin
    await admin.CreateTenant(admin_pb2.CreateTenantRequest(name="acme", token_budget=100,
                                                           cost_budget_micros=10), metadata=as_admin)

    shown = await admin.SetLimits(admin_pb2.SetLimitsRequest(name="acme", kv_token_budget=4_096,
                                                             batch_allowed=True), metadata=as_admin)
    untouched = await admin.SetLimits(admin_pb2.SetLimitsRequest(name="acme", tokens_per_minute=500),
                                      metadata=as_admin)
    cleared = await admin.SetLimits(admin_pb2.SetLimitsRequest(name="acme", kv_token_budget=0,
                                                               batch_allowed=False), metadata=as_admin)

    assert (shown.kv_token_budget, shown.batch_allowed) == (4_096, True)
    assert (untouched.kv_token_budget, untouched.batch_allowed) == (4_096, True)   # fields not sent: kept
    assert (cleared.kv_token_budget, cleared.batch_allowed) == (0, False)         # 0 = no cap
    async with gateway.sessionmaker() as session:
        row = await session.scalar(select(Tenant).where(Tenant.name == "acme"))
    assert row is not None and (row.kv_token_budget, row.batch_allowed) == (None, False)
    log = (await admin.ListAudit(admin_pb2.ListAuditRequest(), metadata=as_admin)).entries
    first = [entry for entry in reversed(log) if entry.action == "tenant.set_limits"][0]
    assert json.loads(first.after_json)["kv_token_budget"] == 4_096
    assert json.loads(first.after_json)["batch_allowed"] is True
