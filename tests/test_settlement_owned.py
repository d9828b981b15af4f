"""A lease holder's settlement (settle_run_usage(owned_by_epoch=...)): one statement on a hot
connection, outside any transaction, as the routing driver runs it (ledger/settlement.py _OWNED).
It charges what settle_run charges, at the run's rates rounded up as pricing.cost_micros does,
only under the holder's epoch, never twice, and writes nothing for counts no run could produce."""

from __future__ import annotations

import uuid

import pytest
from sluice.ledger.models import Model, Run, RunStatus, UsageEntry
from sluice.ledger.pg import HotPool
from sluice.ledger.pricing import cost_micros
from sluice.ledger.settlement import (
    NotOwned,
    OwnedSettlement,
    SettlementError,
    TerminalFix,
    settle_owned_many,
    settle_run_usage,
    settled_usage,
)
from sluice.services.routing.claims import mark_queued
from sqlalchemy import func, select

from tests.support.ledger_factories import (
    DEFAULT_MODEL,
    TenantHandle,
    add_model,
    add_tenant,
    budget_row,
    prompt_of,
)
from tests.support.ledger_services import Services

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]

LEASE_S = 5.0
FIX = TerminalFix(sequence=4, last_sequence=3, lease_owner="w1", lease_seconds=LEASE_S)



async def leased_run(api: Services) -> tuple[TenantHandle, uuid.UUID, int]:
    """A run queued on replica r0 under its first epoch, as a routing worker claims it."""
    async with api.sessionmaker() as session, session.begin():
        if await session.get(Model, DEFAULT_MODEL.version) is None:
            await add_model(session, api.tokenizer)
        tenant = await add_tenant(session, f"t{uuid.uuid4().hex[:6]}")
    run_id = uuid.UUID((await api.submit(tenant, prompt_of(7), 8)).run_id)
    async with api.sessionmaker() as session, session.begin():
        _, epoch = await mark_queued(session, run_id, "r0", "w1", LEASE_S)
    return tenant, run_id, epoch


async def entries(api: Services, run_id: uuid.UUID) -> int:
    async with api.sessionmaker() as session:
        return int(await session.scalar(select(func.count()).select_from(UsageEntry)
                                        .where(UsageEntry.run_id == run_id)) or 0)


async def status(api: Services, run_id: uuid.UUID) -> str:
    async with api.sessionmaker() as session:
        return str(await session.scalar(select(Run.status).where(Run.id == run_id)))


async def test_the_holder_settles_in_one_statement_at_the_runs_rates_rounded_up(
        api: Services, hot_pool: HotPool):
    tenant, run_id, epoch = await leased_run(api)
    async with api.sessionmaker() as session:
        prompt = int(await session.scalar(select(Run.input_tokens).where(Run.id == run_id)) or 0)
    async with hot_pool.connection() as connection:
        settled = await settle_run_usage(connection, run_id, RunStatus.COMPLETED, output_tokens=3,
                                         cached_input_tokens=1, detail=None, owned_by_epoch=epoch,
                                         terminal=FIX)
    # 1 cached token at $0.05/M makes the sum no whole micro-dollar: the charge is rounded up.
    expected = cost_micros(DEFAULT_MODEL, prompt, 1, 3)
    assert settled is not None and (settled.input_tokens, settled.cached_input_tokens, settled.output_tokens,
                                    settled.cost_micros) == (prompt, 1, 3, expected)
    async with api.sessionmaker() as session:
        assert await settled_usage(session, run_id) == settled
        row = (await session.execute(select(Run.status, Run.terminal_sequence, Run.lease_owner)
                                     .where(Run.id == run_id))).one()
    assert tuple(row) == ("COMPLETED", 4, "w1")
    budget = await budget_row(api.sessionmaker, tenant.id)
    assert (budget.reserved_tokens, budget.used_tokens, budget.reserved_cost_micros,
            budget.used_cost_micros) == (0, prompt + 3, 0, expected)


async def test_another_epoch_or_a_second_settlement_is_not_owned_and_writes_nothing(
        api: Services, hot_pool: HotPool):
    _, run_id, epoch = await leased_run(api)
    async with hot_pool.connection() as connection:
        with pytest.raises(NotOwned):
            await settle_run_usage(connection, run_id, RunStatus.COMPLETED, 3, 0, None,
                                   owned_by_epoch=epoch + 1, terminal=FIX)
        assert (await entries(api, run_id), await status(api, run_id)) == (0, "QUEUED")
        assert await settle_run_usage(connection, run_id, RunStatus.COMPLETED, 3, 0, None,
                                      owned_by_epoch=epoch, terminal=FIX) is not None
        with pytest.raises(NotOwned):      # settled: no longer active under any epoch
            await settle_run_usage(connection, run_id, RunStatus.INTERRUPTED, 3, 0, None,
                                   owned_by_epoch=epoch, terminal=FIX)
    assert (await entries(api, run_id), await status(api, run_id)) == (1, "COMPLETED")


async def test_counts_no_run_could_produce_raise_and_write_nothing(api: Services, hot_pool: HotPool):
    _, run_id, epoch = await leased_run(api)
    async with hot_pool.connection() as connection:
        with pytest.raises(SettlementError, match="output_tokens 9 outside 0..8"):
            await settle_run_usage(connection, run_id, RunStatus.COMPLETED, 9, 0, None, owned_by_epoch=epoch)
        with pytest.raises(SettlementError, match="cached_input_tokens 1 outside 0..0"):
            await settle_run_usage(connection, run_id, RunStatus.COMPLETED, 1, 1, None, input_tokens=0,
                                   owned_by_epoch=epoch)
    assert (await entries(api, run_id), await status(api, run_id)) == (0, "QUEUED")


async def test_a_prompt_no_replica_took_is_not_charged(api: Services, hot_pool: HotPool):
    _, run_id, epoch = await leased_run(api)
    async with hot_pool.connection() as connection:
        settled = await settle_run_usage(connection, run_id, RunStatus.INTERRUPTED, 0, 0, "refused",
                                         input_tokens=0, owned_by_epoch=epoch)
    assert settled is not None and (settled.input_tokens, settled.cost_micros) == (0, 0)


async def test_many_runs_settle_in_one_statement_each_under_its_own_epoch_and_counts(
        api: Services, hot_pool: HotPool):
    first_tenant, first, first_epoch = await leased_run(api)
    async with api.sessionmaker() as session, session.begin():
        second = uuid.UUID((await api.submit(first_tenant, prompt_of(7), 8)).run_id)
        _, second_epoch = await mark_queued(session, second, "r0", "w1", LEASE_S)
    other_tenant, other, other_epoch = await leased_run(api)
    _, stale, stale_epoch = await leased_run(api)
    _, impossible, impossible_epoch = await leased_run(api)
    async with api.sessionmaker() as session:
        prompt = int(await session.scalar(select(Run.input_tokens).where(Run.id == first)) or 0)
    items = [OwnedSettlement(first, first_epoch, RunStatus.COMPLETED, 3, 1, None, terminal=FIX),
             OwnedSettlement(stale, stale_epoch + 1, RunStatus.COMPLETED, 3, 0, None, terminal=FIX),
             OwnedSettlement(second, second_epoch, RunStatus.CANCELLED, 2, 0, "cancelled", terminal=FIX),
             OwnedSettlement(impossible, impossible_epoch, RunStatus.COMPLETED, 9, 0, None),
             OwnedSettlement(other, other_epoch, RunStatus.INTERRUPTED, 0, 0, "refused", input_tokens=0)]
    async with hot_pool.connection() as connection:
        settled = await settle_owned_many(connection, items)
    charges = {first: (prompt, 1, 3), second: (prompt, 0, 2), other: (0, 0, 0)}
    assert [(s.owned, s.usage is not None, s.impossible is not None) for s in settled] == [
        (True, True, False), (False, False, False), (True, True, False), (True, False, True),
        (True, True, False)]
    assert str(settled[3].impossible) == f"output_tokens 9 outside 0..8 (the run's cap) for run {impossible}"
    for item, result in zip(items, settled, strict=True):
        if result.usage is not None:
            assert (result.usage.input_tokens, result.usage.cached_input_tokens, result.usage.output_tokens,
                    result.usage.cost_micros) == (*charges[item.run_id], cost_micros(DEFAULT_MODEL,
                                                                                      *charges[item.run_id]))
    assert [(await entries(api, run), await status(api, run)) for run in (first, stale, second, impossible,
                                                                          other)] == [
        (1, "COMPLETED"), (0, "QUEUED"), (1, "CANCELLED"), (0, "QUEUED"), (1, "INTERRUPTED")]
    # One budget row took both of its tenant's runs: their reservations released, their charges used.
    both = await budget_row(api.sessionmaker, first_tenant.id)
    assert (both.reserved_tokens, both.used_tokens, both.reserved_cost_micros, both.used_cost_micros) == (
        0, prompt + 3 + prompt + 2, 0, cost_micros(DEFAULT_MODEL, prompt, 1, 3)
        + cost_micros(DEFAULT_MODEL, prompt, 0, 2))
    alone = await budget_row(api.sessionmaker, other_tenant.id)
    assert (alone.reserved_tokens, alone.used_tokens, alone.used_cost_micros) == (0, 0, 0)
    # Settled once: the same settlements again find nothing of theirs to settle.
    async with hot_pool.connection() as connection:
        again = await settle_owned_many(connection, [items[0], items[2]])
    assert [(s.owned, s.usage) for s in again] == [(False, None), (False, None)]
    assert (await budget_row(api.sessionmaker, first_tenant.id)) == both
