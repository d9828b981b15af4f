"""Idempotent submit and budget atomicity under concurrency, against the real PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import pytest
from sluice.ledger.models import Model, Run
from sluice.services import errors
from sqlalchemy import select, update

from tests.support.ledger_factories import (
    DEFAULT_MODEL,
    ModelSpec,
    add_model,
    add_tenant,
    budget_row,
    count_runs,
)

if TYPE_CHECKING:
    from tests.support.ledger_factories import TenantHandle
    from tests.support.ledger_services import Services

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]
pytestmark = pytest.mark.integration


async def setup(api: Services, spec: ModelSpec = DEFAULT_MODEL, **budget: int) -> TenantHandle:
    async with api.sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, spec)
        return await add_tenant(session, "acme", **budget)


async def test_the_same_key_and_payload_returns_the_same_run_and_reserves_once(api):
    tenant = await setup(api)

    first = await api.submit(tenant, "alpha bravo", 10, request_key="order-1")
    second = await api.submit(tenant, "alpha bravo", 10, request_key="order-1")

    assert second.run_id == first.run_id
    assert (first.deduplicated, second.deduplicated) == (False, True)
    assert await count_runs(api.sessionmaker) == 1
    assert (await budget_row(api.sessionmaker, tenant.id)).reserved_tokens == 12


async def test_the_same_key_with_another_payload_is_already_exists_and_changes_nothing(api):
    tenant = await setup(api)
    await api.submit(tenant, "alpha bravo", 10, request_key="order-1")
    before = await budget_row(api.sessionmaker, tenant.id)

    for other in (
        api.submit(tenant, "alpha charlie", 10, request_key="order-1"),   # other input
        api.submit(tenant, "alpha bravo", 11, request_key="order-1"),     # other cap
        api.submit(tenant, "alpha bravo", 10, request_key="order-1", temperature=0.5),  # other sampling
        api.submit(tenant, "alpha bravo", 10, request_key="order-1", model="test-model-v1"),  # model name
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await other
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert caught.value.details() == errors.REQUEST_KEY_REUSED.format(key="order-1")

    assert await count_runs(api.sessionmaker) == 1
    assert await budget_row(api.sessionmaker, tenant.id) == before


async def test_a_request_key_belongs_to_its_tenant_only(api):
    tenant = await setup(api)
    async with api.sessionmaker() as session, session.begin():
        other = await add_tenant(session, "other")

    mine = await api.submit(tenant, "alpha", 5, request_key="shared-key")
    theirs = await api.submit(other, "alpha", 5, request_key="shared-key")

    assert mine.run_id != theirs.run_id
    assert not theirs.deduplicated


async def test_a_retry_after_the_alias_moves_finds_the_run_pinned_to_the_first_version(api):
    tenant = await setup(api)
    first = await api.submit(tenant, "alpha", 5, request_key="pinned", model="test")
    async with api.sessionmaker() as session, session.begin():
        await session.execute(update(Model).values(alias=None))
        await add_model(session, api.tokenizer, ModelSpec(version="test-model-v2", alias="test"))

    retry = await api.submit(tenant, "alpha", 5, request_key="pinned", model="test")
    fresh = await api.submit(tenant, "alpha", 5, request_key="new", model="test")

    assert (retry.run_id, retry.model_version, retry.deduplicated) == (first.run_id, "test-model-v1", True)
    assert fresh.model_version == "test-model-v2"


async def test_a_key_refused_for_budget_stays_free_for_a_smaller_retry(api):
    tenant = await setup(api, token_budget=100)

    with pytest.raises(grpc.aio.AioRpcError):
        await api.submit(tenant, "alpha", 500, request_key="order-1")
    smaller = await api.submit(tenant, "alpha", 99, request_key="order-1")

    assert not smaller.deduplicated


async def test_twenty_concurrent_identical_submits_make_one_run_and_one_reservation(api):
    tenant = await setup(api)

    responses = await asyncio.gather(
        *(api.submit(tenant, "alpha bravo charlie", 20, request_key="burst") for _ in range(20))
    )

    assert len({r.run_id for r in responses}) == 1
    assert sorted(r.deduplicated for r in responses) == [False] + [True] * 19
    assert await count_runs(api.sessionmaker) == 1
    budget = await budget_row(api.sessionmaker, tenant.id)
    assert budget.reserved_tokens == 23


async def test_fifty_concurrent_submits_never_overshoot_and_exactly_those_that_fit_are_accepted(api):
    # Each submit reserves 50 prompt + 50 cap = 100 tokens; 2,550 tokens hold exactly 25 of them.
    tenant = await setup(api, token_budget=2_550)
    prompt = " ".join(["alpha"] * 50)

    outcomes = await asyncio.gather(
        *(api.submit(tenant, prompt, 50, request_key=f"k-{i}") for i in range(50)), return_exceptions=True
    )

    accepted = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert (len(accepted), len(refused)) == (25, 25)
    assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    budget = await budget_row(api.sessionmaker, tenant.id)
    assert (budget.reserved_tokens, budget.used_tokens) == (2_500, 0)
    async with api.sessionmaker() as session:
        runs = (await session.scalars(select(Run).where(Run.tenant_id == tenant.id))).all()
    assert sorted(str(r.id) for r in runs) == sorted(a.run_id for a in accepted)
    assert sum(r.reserved_tokens for r in runs) == budget.reserved_tokens
    assert sum(r.reserved_cost_micros for r in runs) == budget.reserved_cost_micros
