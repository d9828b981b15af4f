"""A Submit decided on the context its gateway read a moment ago (services/submit_contexts.py): one
statement, whose write checks that all it took from the cache still holds. Every change an admin or
the load can make between two Submits is made here after a first Submit warmed the cache, and the next
Submit must answer exactly as a fresh read would, on the real PostgreSQL: each guard of the write
(ledger/admission_sql._WRITE_HELD) has a test that fails without it.

The bounds' arithmetic (services/admission_rules.largest_waiting_within, services/traffic.backlog_bounds)
is checked from first principles: the deadline floor is queue wait + prefill + decode, each rounded up
to whole ms, the queue wait being waiting runs / drain rate.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import pytest
from sluice.ledger.admission_sql import BacklogBounds, RowVersions, SubmitContext
from sluice.ledger.models import KeyScope, Run
from sluice.ledger.repositories import Caller, ModelInfo, TenantInfo
from sluice.services.admission_rules import PoolPace, largest_waiting_within
from sluice.services.submit_contexts import SubmitContexts, cacheable
from sluice.services.traffic import DEFAULT_TRAFFIC, TrafficSettings, backlog_bounds
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import Settings, load_settings
from sluice.traffic.ladder import LadderThresholds
from sluice.traffic.priority import Priority
from sluice.traffic.route import RouteReason
from sluice.v1 import common_pb2
from tests.support.ledger_factories import DEFAULT_MODEL, ModelSpec, add_model, add_tenant, prompt_of
from tests.support.ledger_services import serve_ledger

if TYPE_CHECKING:
    from tests.support.ledger_factories import TenantHandle
    from tests.support.ledger_services import Services

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]


# --- the bounds, pure ----------------------------------------------------------------------------

def test_the_most_runs_that_may_wait_is_what_the_deadline_leaves_after_prefill_and_decode():
    pace = PoolPace(max_backlog=100, drain_runs_per_s=10.0, ms_per_prompt_token=1.0, ms_per_output_token=2.0)
    # 100 prompt tokens x 1 ms + 50 output x 2 ms = 200 ms of service; a 1,000 ms deadline leaves 800 ms
    # of queue, and runs leave the queue at 10/s (100 ms each): 8 may wait, not 9.
    assert largest_waiting_within(1_000, 100, 50, pace) == 8
    assert largest_waiting_within(999, 100, 50, pace) == 7
    assert largest_waiting_within(200, 100, 50, pace) == 0     # no queue at all fits, none waiting does
    assert largest_waiting_within(199, 100, 50, pace) == -1    # not even an empty queue
    # 3 runs/s: a run leaves every 333.3 ms, waits rounded up to whole ms (334, 667, 1000).
    thirds = PoolPace(max_backlog=100, drain_runs_per_s=3.0, ms_per_prompt_token=0.0, ms_per_output_token=0.0)
    assert largest_waiting_within(1_000, 0, 0, thirds) == 3
    assert largest_waiting_within(999, 0, 0, thirds) == 2


def traffic(shed_batch: int, fallback: int, shed: int, max_batch: int) -> TrafficSettings:
    ladder = LadderThresholds(shed_batch_backlog=shed_batch, fallback_backlog=fallback, shed_backlog=shed,
                              configured_drain_runs_per_s=10.0)
    return dataclasses.replace(DEFAULT_TRAFFIC, ladder=ladder, max_batch_backlog=max_batch)


def test_an_interactive_submit_holds_below_the_fallback_step_and_within_its_deadline():
    settings = traffic(shed_batch=2, fallback=5, shed=10, max_batch=7)
    # Fallbacks start at 5 waiting: up to 4 the ladder does nothing to an interactive submit.
    assert backlog_bounds(Priority.INTERACTIVE, 100, settings) == BacklogBounds(4, 0, 4, count_batch=False)
    assert backlog_bounds(Priority.INTERACTIVE, 3, settings) == BacklogBounds(3, 0, 3, count_batch=False)
    assert backlog_bounds(Priority.INTERACTIVE, -1, settings) is None


def test_a_batch_submit_holds_below_batch_shedding_by_either_backlog_and_within_its_deadline():
    settings = traffic(shed_batch=2, fallback=5, shed=10, max_batch=7)
    # Batch is shed from 2 interactive runs waiting or 7 batch runs; it waits behind both within 9.
    assert backlog_bounds(Priority.BATCH, 9, settings) == BacklogBounds(1, 6, 9, count_batch=True)
    assert backlog_bounds(Priority.BATCH, -1, settings) is None


# --- the cache, pure ------------------------------------------------------------------------------

def context(*, rate_limited: bool = False, canary_active: bool = False, model: bool = True) -> SubmitContext:
    tenant = TenantInfo(id=uuid.uuid4(), name="acme", allowed_tiers=("standard",),
                        max_concurrent_runs=4 if rate_limited else None, api_key_id=uuid.uuid4())
    caller = Caller(key_id=uuid.uuid4(), key_prefix="sk-0", scope=KeyScope.TENANT, tenant=tenant)
    info = ModelInfo("v1", "test", "tok.json", 100, "v1", "standard", 1, 1, 1, 1) if model else None
    return SubmitContext(caller, info, 3, RouteReason.ALIAS, batch_backlog=2,
                         versions=RowVersions("10", "11") if model else None, canary_active=canary_active)


def test_a_kept_context_is_served_without_its_backlog_until_it_is_stale():
    now = [0.0]
    contexts = SubmitContexts(fresh_s=30.0, clock=lambda: now[0])
    contexts.put("sk-a", "test", context())
    kept = contexts.get("sk-a", "test")
    assert kept is not None and (kept.backlog, kept.batch_backlog) == (0, 0)   # the write counts them
    assert contexts.get("sk-b", "test") is None and contexts.get("sk-a", "other") is None
    now[0] = 29.9
    assert contexts.get("sk-a", "test") is not None
    now[0] = 30.0
    assert contexts.get("sk-a", "test") is None and len(contexts) == 0


def test_only_plain_contexts_are_kept_and_the_oldest_go_first():
    assert cacheable(context())
    assert not cacheable(context(rate_limited=True))     # the transactional path's, under the tenant lock
    assert not cacheable(context(canary_active=True))    # a split decided per run
    assert not cacheable(context(model=False))
    contexts = SubmitContexts(limit=2)
    for key in ("sk-1", "sk-2", "sk-3"):
        contexts.put(key, "test", context())
    assert contexts.get("sk-1", "test") is None
    assert contexts.get("sk-2", "test") is not None and contexts.get("sk-3", "test") is not None
    assert all(b"sk-" not in slot[0] for slot in contexts._entries)   # a digest of the key, never it


# --- on PostgreSQL ---------------------------------------------------------------------------------

def deadline_config() -> Settings:
    """10 runs/s drain, 1 ms per output token, no prompt cost: a 5-token cap takes 5 ms, and each run
    waiting ahead adds 100 ms; fallbacks from 50 waiting, so only the deadline bounds the backlog."""
    return load_settings().updated(
        admission={"max_backlog_per_pool": 100, "pool_drain_runs_per_s": 10.0,
                   "expected_ms_per_prompt_token": 0.0, "expected_ms_per_output_token": 1.0})


@pytest.fixture
async def paced(sessionmaker: async_sessionmaker[AsyncSession],
                word_tokenizer: str) -> AsyncIterator[Services]:
    async with serve_ledger(sessionmaker, word_tokenizer, deadline_config()) as services:
        yield services


async def setup(api: Services) -> TenantHandle:
    async with api.sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, DEFAULT_MODEL)
        return await add_tenant(session, "acme")


async def execute(api: Services, sql: str, **params: object) -> None:
    async with api.sessionmaker() as session, session.begin():
        await session.execute(text(sql), params)


async def refused(call: object, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call      # type: ignore[misc]
    assert caught.value.code() == code, caught.value.details()
    return caught.value


async def warmed(api: Services) -> TenantHandle:
    """A tenant whose key and model the gateway has read (its context kept)."""
    tenant = await setup(api)
    await api.submit(tenant, prompt_of(10), 5)
    assert api.service is not None and len(api.service._contexts) == 1
    return tenant


async def run_of(api: Services, run_id: str) -> Run:
    async with api.sessionmaker() as session:
        run = await session.get(Run, uuid.UUID(run_id))
        assert run is not None
        return run


@pytest.mark.integration
@pytest.mark.parametrize(("change", "code"), [
    ("UPDATE api_keys SET revoked_at = now() WHERE tenant_id = :t", grpc.StatusCode.UNAUTHENTICATED),
    ("UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE tenant_id = :t",
     grpc.StatusCode.UNAUTHENTICATED),
    ("UPDATE tenants SET suspended_at = now() WHERE id = :t", grpc.StatusCode.PERMISSION_DENIED),
    ("UPDATE tenants SET allowed_tiers = '{premium}' WHERE id = :t", grpc.StatusCode.PERMISSION_DENIED),
], ids=["key revoked", "key expired", "tenant suspended", "tier no longer allowed"])
async def test_a_caller_changed_after_its_context_was_kept_is_refused_at_once(api: Services, change: str,
                                                                                code: grpc.StatusCode):
    tenant = await warmed(api)
    await execute(api, change, t=tenant.id)
    await refused(api.submit(tenant, prompt_of(10), 5), code)


@pytest.mark.integration
async def test_a_price_changed_after_the_context_was_kept_is_the_one_reserved(api: Services):
    tenant = await warmed(api)
    # 10 prompt tokens at $0.50/M and 5 output at the default card: the new input price is 10x.
    await execute(api, "UPDATE models SET price_input_per_m_micros = price_input_per_m_micros * 10"
                       " WHERE version = :v", v=DEFAULT_MODEL.version)
    answer = await api.submit(tenant, prompt_of(10), 5)
    run = await run_of(api, answer.run_id)
    expected = -(-(10 * DEFAULT_MODEL.price_input_per_m_micros * 10
                   + 5 * DEFAULT_MODEL.price_output_per_m_micros) // 1_000_000)
    assert run.reserved_cost_micros == expected


@pytest.mark.integration
async def test_a_name_that_now_resolves_elsewhere_pins_the_run_where_a_fresh_read_would(api: Services):
    tenant = await warmed(api)              # "test" is the alias of test-model-v1
    # A model whose version is spelled "test": an exact version wins over an alias (the read's order).
    # The kept context's rows are untouched: only the write's resolution of the name sees it.
    async with api.sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, ModelSpec(version="test", alias=None))
    answer = await api.submit(tenant, prompt_of(10), 5)
    assert answer.model_version == "test"


@pytest.mark.integration
async def test_a_canary_started_after_the_context_was_kept_splits_the_next_run(api: Services):
    tenant = await warmed(api)
    async with api.sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, ModelSpec(version="test-model-v2", alias=None))
    # The whole share to the candidate: every split point goes there.
    await execute(api, "INSERT INTO canaries (alias, baseline_version, candidate_version, share_bp, window_s,"
                       " min_samples, max_ttft_ratio, max_tpot_ratio, max_failure_rate_increase)"
                       " VALUES ('test', :base, 'test-model-v2', 10000, 60, 10, 2, 2, 0.1)",
                  base=DEFAULT_MODEL.version)
    answer = await api.submit(tenant, prompt_of(10), 5)
    assert answer.model_version == "test-model-v2"


@pytest.mark.integration
async def test_a_backlog_grown_past_the_deadline_bound_is_refused_as_a_fresh_read_refuses_it(paced: Services):
    tenant = await warmed(paced)                           # 1 run waiting now (nothing claims it)
    # A 5-token cap decodes in 5 ms; a 210 ms deadline leaves 205 ms of queue: 2 runs may wait.
    await paced.submit(tenant, prompt_of(10), 5, deadline_ms=210)      # 1 waiting: admitted, 2 now
    await paced.submit(tenant, prompt_of(10), 5, deadline_ms=210)      # 2 waiting: admitted, 3 now
    await refused(paced.submit(tenant, prompt_of(10), 5, deadline_ms=210), grpc.StatusCode.DEADLINE_EXCEEDED)
    await paced.submit(tenant, prompt_of(10), 5, deadline_ms=310)      # 3 waiting: 305 ms of queue


@pytest.mark.integration
async def test_a_batch_run_waits_behind_both_backlogs_and_the_write_bounds_their_sum(paced: Services):
    tenant = await warmed(paced)                           # 1 interactive run waiting
    await execute(paced, "UPDATE tenants SET batch_allowed = true WHERE id = :t", t=tenant.id)
    batch = common_pb2.PRIORITY_BATCH
    # 210 ms leaves 205 ms of queue at 100 ms a run: 2 may wait ahead, interactive and batch together.
    await paced.submit(tenant, prompt_of(10), 5, deadline_ms=210, priority=batch)   # 1 + 0 ahead
    await paced.submit(tenant, prompt_of(10), 5, deadline_ms=210, priority=batch)   # 1 + 1 ahead
    await refused(paced.submit(tenant, prompt_of(10), 5, deadline_ms=210, priority=batch),
                  grpc.StatusCode.DEADLINE_EXCEEDED)                                 # 1 + 2 ahead
