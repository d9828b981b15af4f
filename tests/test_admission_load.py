"""Load shedding, deadline feasibility and the accept notification, on the real PostgreSQL.

Admission is served in-process with a tight [admission] pace: at most 3 runs may wait per model,
the pool drains 10 runs/s (so 3 waiting = 300 ms of queue), prefill is 0.5 ms per prompt token and
decoding 7 ms per output token. Nothing here runs a routing worker: a run "claimed" by one is
marked QUEUED by hand.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import asyncpg
import grpc
import grpc.aio
import pytest
from sluice.ledger.channels import RUNS_ACCEPTED_CHANNEL
from sluice.ledger.models import Run, RunStatus
from sluice.services import errors
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import Settings, load_settings
from sluice.v1 import common_pb2
from tests.support.db import asyncpg_dsn
from tests.support.ledger_factories import (
    DEFAULT_MODEL,
    ModelSpec,
    add_model,
    add_tenant,
    budget_row,
    count_runs,
    prompt_of,
)
from tests.support.ledger_services import serve_ledger

if TYPE_CHECKING:
    from tests.support.ledger_factories import TenantHandle
    from tests.support.ledger_services import Services

pytestmark = pytest.mark.integration

POOL = DEFAULT_MODEL.version         # the factories give each model a worker pool named after it
TIGHT_PACE = {
    "max_backlog_per_pool": 3,
    "pool_drain_runs_per_s": 10.0,
    "expected_ms_per_prompt_token": 0.5,
    "expected_ms_per_output_token": 7.0,
}


def tight_config() -> Settings:
    return load_settings().updated(admission=TIGHT_PACE)


@pytest.fixture
async def tight(sessionmaker: async_sessionmaker[AsyncSession],
                word_tokenizer: str) -> AsyncIterator[Services]:
    async with serve_ledger(sessionmaker, word_tokenizer, tight_config()) as services:
        yield services


async def setup(api: Services, *models: ModelSpec) -> TenantHandle:
    async with api.sessionmaker() as session, session.begin():
        for spec in models or (DEFAULT_MODEL,):
            await add_model(session, api.tokenizer, spec)
        return await add_tenant(session, "acme")


async def refused(call: Any, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    return caught.value


def trailing(error: grpc.aio.AioRpcError) -> dict[str, str]:
    return {key: str(value) for key, value in error.trailing_metadata() or ()}


async def mark_claimed(api: Services, run_id: str) -> None:
    """What a routing worker's claim does to the backlog: the run leaves ACCEPTED."""
    async with api.sessionmaker() as session, session.begin():
        await session.execute(
            update(Run).where(Run.id == uuid.UUID(run_id)).values(status=RunStatus.QUEUED.value))


# --- shedding under overload --------------------------------------------------------------------


async def test_a_submit_past_a_full_backlog_is_shed_with_retry_after_and_writes_nothing(tight):
    tenant = await setup(tight)
    for _ in range(3):
        await tight.submit(tenant, "alpha", 5)
    before = await budget_row(tight.sessionmaker, tenant.id)

    error = await refused(tight.submit(tenant, "alpha", 5), grpc.StatusCode.UNAVAILABLE)

    # 3 runs waiting at 10 runs/s: 300 ms until the queue it would have joined is gone.
    assert error.details() == errors.POOL_BACKLOG_FULL.format(
        model=POOL, pool=POOL, backlog=3, limit=3, retry_after_ms=300)
    assert error.details().endswith("(at most 3 may wait): retry after 300 ms")
    assert trailing(error)[errors.RETRY_AFTER_MS_KEY] == "300"
    assert await count_runs(tight.sessionmaker) == 3
    assert await budget_row(tight.sessionmaker, tenant.id) == before


async def test_a_run_claimed_by_routing_makes_room_for_the_next_submit(tight):
    tenant = await setup(tight)
    first, *_ = [await tight.submit(tenant, "alpha", 5) for _ in range(3)]
    await refused(tight.submit(tenant, "alpha", 5), grpc.StatusCode.UNAVAILABLE)

    await mark_claimed(tight, first.run_id)
    response = await tight.submit(tenant, "alpha", 5)

    assert response.status == common_pb2.RUN_STATUS_ACCEPTED and not response.deduplicated
    assert await count_runs(tight.sessionmaker) == 4


async def test_a_retry_of_an_accepted_run_gets_that_run_even_when_the_backlog_is_full(tight):
    tenant = await setup(tight)
    original = await tight.submit(tenant, "alpha", 5, request_key="retry-me")
    for _ in range(2):
        await tight.submit(tenant, "alpha", 5)

    again = await tight.submit(tenant, "alpha", 5, request_key="retry-me")
    other_payload = await refused(tight.submit(tenant, "bravo", 5, request_key="retry-me"),
                                  grpc.StatusCode.ALREADY_EXISTS)

    assert (again.run_id, again.deduplicated) == (original.run_id, True)
    assert other_payload.details() == errors.REQUEST_KEY_REUSED.format(key="retry-me")
    assert await count_runs(tight.sessionmaker) == 3


async def test_the_backlog_is_counted_per_model(tight):
    other = ModelSpec(version="other-model-v1", alias="other")
    tenant = await setup(tight, DEFAULT_MODEL, other)
    for _ in range(3):
        await tight.submit(tenant, "alpha", 5)

    response = await tight.submit(tenant, "alpha", 5, model="other")

    assert response.model_version == "other-model-v1"
    await refused(tight.submit(tenant, "alpha", 5), grpc.StatusCode.UNAVAILABLE)


async def test_a_burst_may_overshoot_the_bound_only_while_its_submits_are_in_flight(tight):
    tenant = await setup(tight)

    results = await asyncio.gather(*(tight.submit(tenant, "alpha", 5) for _ in range(24)),
                                   return_exceptions=True)

    accepted = [r for r in results if not isinstance(r, BaseException)]
    shed = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(accepted) + len(shed) == 24
    assert all(error.code() == grpc.StatusCode.UNAVAILABLE for error in shed)
    # Each submit counts committed runs only, so racing submits may all see room; once they have
    # committed the gate is shut for everyone.
    assert len(accepted) >= 3
    assert await count_runs(tight.sessionmaker) == len(accepted)
    await refused(tight.submit(tenant, "alpha", 5), grpc.StatusCode.UNAVAILABLE)


# --- deadline feasibility -------------------------------------------------------------------------


async def test_a_deadline_the_run_cannot_meet_is_refused_with_what_would_do_and_writes_nothing(tight):
    tenant = await setup(tight)

    # 10 prompt tokens × 0.5 ms + 100 output tokens × 7 ms = 705 ms at the least.
    error = await refused(tight.submit(tenant, prompt_of(10), 100, deadline_ms=500),
                          grpc.StatusCode.DEADLINE_EXCEEDED)

    assert error.details() == errors.DEADLINE_CANNOT_BE_MET.format(
        deadline_ms=500, queue_ms=0, prompt=10, prefill_ms=5, cap=100, decode_ms=700, floor_ms=705,
        advice=errors.DEADLINE_ADVICE_RAISE_OR_LOWER_CAP.format(floor_ms=705, fit=70))
    assert error.details().endswith(
        "raise deadline_ms to at least 705 or lower max_output_tokens to at most 70")
    assert trailing(error)[errors.MIN_DEADLINE_MS_KEY] == "705"
    assert trailing(error)[errors.MAX_OUTPUT_TOKENS_THAT_FIT_KEY] == "70"
    assert await count_runs(tight.sessionmaker) == 0
    assert (await budget_row(tight.sessionmaker, tenant.id)).reserved_tokens == 0


async def test_either_suggestion_is_accepted_while_the_queue_stays_as_it_was(tight):
    tenant = await setup(tight)
    await refused(tight.submit(tenant, prompt_of(10), 100, deadline_ms=500),
                  grpc.StatusCode.DEADLINE_EXCEEDED)

    longer = await tight.submit(tenant, prompt_of(10), 100, deadline_ms=705)
    await mark_claimed(tight, longer.run_id)  # else it would queue 100 ms ahead of the next one
    smaller = await tight.submit(tenant, prompt_of(10), 70, deadline_ms=500)

    assert (longer.max_output_tokens, smaller.max_output_tokens) == (100, 70)


async def test_runs_waiting_ahead_raise_the_floor_by_their_queue_time(tight):
    tenant = await setup(tight)
    for _ in range(2):
        await tight.submit(tenant, "alpha", 5)

    # 2 runs ahead at 10 runs/s = 200 ms before this one can start.
    error = await refused(tight.submit(tenant, prompt_of(10), 100, deadline_ms=800),
                          grpc.StatusCode.DEADLINE_EXCEEDED)

    assert error.details() == errors.DEADLINE_CANNOT_BE_MET.format(
        deadline_ms=800, queue_ms=200, prompt=10, prefill_ms=5, cap=100, decode_ms=700, floor_ms=905,
        advice=errors.DEADLINE_ADVICE_RAISE_OR_LOWER_CAP.format(floor_ms=905, fit=85))


async def test_the_default_deadline_applies_when_the_request_sends_none(tight):
    tenant = await setup(tight)
    # Default 600 s: a cap of 16,000 needs 112 s of decoding, which fits.
    response = await tight.submit(tenant, "alpha", 16_000, deadline_ms=0)
    assert response.status == common_pb2.RUN_STATUS_ACCEPTED


async def test_a_normal_submit_with_the_shipped_config_is_unaffected(api):
    tenant = await setup(api)
    responses = [await api.submit(tenant, prompt_of(200), 4_000) for _ in range(5)]
    assert [r.status for r in responses] == [common_pb2.RUN_STATUS_ACCEPTED] * 5
    assert await count_runs(api.sessionmaker) == 5


# --- NOTIFY on accept -----------------------------------------------------------------------------


@pytest.fixture
async def accepted_notifications(database_dsn: str) -> AsyncIterator[asyncio.Queue[str]]:
    """Payloads of RUNS_ACCEPTED_CHANNEL as a LISTEN connection on the test database receives them."""
    received: asyncio.Queue[str] = asyncio.Queue()
    connection = await asyncpg.connect(asyncpg_dsn(database_dsn))
    await connection.add_listener(RUNS_ACCEPTED_CHANNEL, lambda *args: received.put_nowait(args[3]))
    try:
        yield received
    finally:
        await connection.close()


async def nothing_more(received: asyncio.Queue[str], settle_s: float = 0.3) -> bool:
    await asyncio.sleep(settle_s)
    return received.empty()


async def test_a_new_run_notifies_routing_with_its_worker_pool(tight, accepted_notifications):
    tenant = await setup(tight)

    await tight.submit(tenant, "alpha", 5)

    assert await asyncio.wait_for(accepted_notifications.get(), 5) == POOL
    assert await nothing_more(accepted_notifications)


async def test_refused_and_deduplicated_submits_notify_nobody(tight, accepted_notifications):
    tenant = await setup(tight)
    await refused(tight.submit(tenant, prompt_of(10), 100, deadline_ms=500),
                  grpc.StatusCode.DEADLINE_EXCEEDED)
    await refused(tight.submit(tenant, "alpha", 5, model="nope"), grpc.StatusCode.NOT_FOUND)
    assert await nothing_more(accepted_notifications)

    await tight.submit(tenant, "alpha", 5, request_key="once")
    assert await asyncio.wait_for(accepted_notifications.get(), 5) == POOL
    await tight.submit(tenant, "alpha", 5, request_key="once")  # deduplicated
    for _ in range(2):
        await tight.submit(tenant, "alpha", 5)
    assert [await asyncio.wait_for(accepted_notifications.get(), 5) for _ in range(2)] == [POOL, POOL]
    await refused(tight.submit(tenant, "alpha", 5), grpc.StatusCode.UNAVAILABLE)  # shed
    assert await nothing_more(accepted_notifications)


async def test_a_submit_refused_for_budget_after_its_insert_notifies_nobody(tight, accepted_notifications):
    async with tight.sessionmaker() as session, session.begin():
        await add_model(session, tight.tokenizer)
        tenant = await add_tenant(session, "poor", token_budget=10)

    await refused(tight.submit(tenant, "alpha", 50), grpc.StatusCode.RESOURCE_EXHAUSTED)

    assert await nothing_more(accepted_notifications)
    assert await count_runs(tight.sessionmaker) == 0
