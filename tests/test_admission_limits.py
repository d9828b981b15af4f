"""Concurrent-run and tokens-per-minute limits hold across admission instances (real PostgreSQL).

"A limiter kept per instance lets a tenant exceed quota × instances": here two Admission servers,
each with its own engine and connection pool, share one ledger, and the limits still hold exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import pytest
from sluice.ledger.db import make_engine, make_sessionmaker
from sluice.ledger.models import Run, RunStatus
from sluice.ledger.settlement import settle_run
from sluice.services import errors
from sluice.services.admission import add_admission_servicer
from sqlalchemy import update

from sluice.config import load_settings
from sluice.v1 import admission_pb2_grpc
from tests.support.ledger_factories import add_model, add_tenant, count_runs, prompt_of

if TYPE_CHECKING:
    from tests.support.ledger_factories import TenantHandle
    from tests.support.ledger_services import Services

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]
pytestmark = pytest.mark.integration


async def setup(api: Services, **limits: int) -> TenantHandle:
    async with api.sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer)
        return await add_tenant(session, "acme", **limits)


@pytest.fixture
async def second_instance(api: Services, database_dsn: str) -> AsyncIterator[Services]:
    """Another Admission server with its own engine and pool on the same database."""
    engine = make_engine(database_dsn, pool_size=20, max_overflow=0)
    server = grpc.aio.server()
    admission = add_admission_servicer(server, make_sessionmaker(engine), load_settings())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield dataclasses.replace(api, admission=admission_pb2_grpc.AdmissionStub(channel))
    finally:
        await channel.close()
        await server.stop(None)
        await admission.close()
        await engine.dispose()


async def refusal(call) -> grpc.aio.AioRpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return caught.value


# --- concurrent runs ------------------------------------------------------------------------------


async def test_the_run_past_the_concurrency_limit_is_refused_until_one_finishes(api):
    tenant = await setup(api, max_concurrent_runs=3)
    first, *_ = [await api.submit(tenant, "alpha", 5) for _ in range(3)]

    error = await refusal(api.submit(tenant, "alpha", 5))

    assert error.details() == errors.CONCURRENCY_LIMIT.format(active=3, limit=3)
    assert await count_runs(api.sessionmaker) == 3
    async with api.sessionmaker() as session, session.begin():
        await settle_run(session, uuid.UUID(first.run_id), RunStatus.CANCELLED, 0, 0, None)
    assert (await api.submit(tenant, "alpha", 5)).run_id


async def test_a_retry_of_an_admitted_run_is_answered_even_at_the_limit(api):
    tenant = await setup(api, max_concurrent_runs=1)
    first = await api.submit(tenant, "alpha", 5, request_key="only")

    again = await api.submit(tenant, "alpha", 5, request_key="only")

    assert (again.run_id, again.deduplicated) == (first.run_id, True)


async def test_the_concurrency_limit_holds_across_two_admission_instances(api, second_instance):
    tenant = await setup(api, max_concurrent_runs=5)

    outcomes = await asyncio.gather(
        *((api if i % 2 else second_instance).submit(tenant, "alpha", 5) for i in range(24)),
        return_exceptions=True,
    )

    accepted = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert (len(accepted), len(refused)) == (5, 19)
    assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert await count_runs(api.sessionmaker) == 5


# --- tokens per minute ----------------------------------------------------------------------------


async def test_tokens_past_the_per_minute_limit_are_refused_with_when_to_retry(api):
    tenant = await setup(api, tokens_per_minute=1_000)
    await api.submit(tenant, prompt_of(100), 500)   # 600 tokens

    error = await refusal(api.submit(tenant, prompt_of(100), 500))

    hints = dict(error.trailing_metadata())
    wait_ms = int(hints[errors.RETRY_AFTER_MS_KEY])
    assert 55_000 < wait_ms <= 60_000
    assert error.details() == errors.TOKENS_PER_MINUTE_LIMIT.format(
        admitted=600, limit=1_000, needed=600, retry_after_ms=wait_ms
    )
    assert await count_runs(api.sessionmaker) == 1


async def test_the_window_slides_tokens_admitted_over_a_minute_ago_no_longer_count(api):
    tenant = await setup(api, tokens_per_minute=1_000)
    first = await api.submit(tenant, prompt_of(100), 500)
    async with api.sessionmaker() as session, session.begin():
        await session.execute(
            update(Run).where(Run.id == uuid.UUID(first.run_id))
            .values(created_at=Run.created_at - dt.timedelta(seconds=61))
        )

    second = await api.submit(tenant, prompt_of(100), 500)

    assert not second.deduplicated


async def test_a_request_larger_than_the_per_minute_limit_is_told_what_would_fit(api):
    tenant = await setup(api, tokens_per_minute=1_000)

    error = await refusal(api.submit(tenant, prompt_of(100), 1_100))

    assert error.details() == errors.TOKENS_PER_MINUTE_NEVER_FITS.format(
        needed=1_200, limit=1_000, advice=errors.CONTEXT_ADVICE_LOWER_CAP.format(fit=900)
    )


async def test_the_per_minute_limit_holds_across_two_admission_instances(api, second_instance):
    tenant = await setup(api, tokens_per_minute=1_000)

    outcomes = await asyncio.gather(
        *((api if i % 2 else second_instance).submit(tenant, prompt_of(50), 50) for i in range(30)),
        return_exceptions=True,
    )

    accepted = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(accepted) == 10
    assert await count_runs(api.sessionmaker) == 10
