"""Runs.GetRun and Runs.Cancel on the gateway's raw pool (ledger/run_calls_sql.py), on the real
PostgreSQL: the keys they take (as Stream and Submit do), what they answer, and what they cost.

GetRun is one statement; Cancel of a run in progress is that lookup and one UPDATE carrying the
NOTIFY to its worker; neither touches SQLAlchemy. Runs are set QUEUED/RUNNING/terminal by hand
(no worker runs here), so no event log is needed: the stub refuses to be read."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import grpc
import grpc.aio
import pytest
from sluice.ledger.channels import CANCEL_CHANNEL
from sluice.ledger.db import dsn_of
from sluice.ledger.models import KeyScope, Run
from sluice.ledger.pg import asyncpg_dsn
from sluice.services.runs import RunsService
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from sluice.v1 import common_pb2, runs_pb2, runs_pb2_grpc
from tests.support.ledger_factories import DEFAULT_MODEL, add_model, add_tenant, get_run, prompt_of
from tests.test_admission_hot_path import RecordingPool, record_statements
from tests.test_runs_stream_keys import UnreadLog, add_key, serve_runs

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]
pytestmark = pytest.mark.integration


@dataclass(frozen=True, slots=True)
class RunsApi:
    stub: runs_pb2_grpc.RunsStub
    hot: RecordingPool               # the service's raw pool, recording every statement


@pytest.fixture
async def runs(sessionmaker: async_sessionmaker[AsyncSession]) -> AsyncIterator[RunsApi]:
    service = RunsService(sessionmaker, UnreadLog(), lease_seconds=10.0)   # type: ignore[arg-type]
    recording = RecordingPool(service._hot)
    service._hot = recording   # type: ignore[assignment]
    async with serve_runs(service) as stub:
        yield RunsApi(stub, recording)


async def set_run(sessionmaker: async_sessionmaker[AsyncSession], run_id: str, **values: object) -> None:
    async with sessionmaker() as session, session.begin():
        await session.execute(update(Run).where(Run.id == uuid.UUID(run_id)).values(**values))


async def test_get_run_and_cancel_take_the_keys_stream_takes(api, runs: RunsApi):  # type: ignore[no-untyped-def]
    async with api.sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, DEFAULT_MODEL)
        tenant = await add_tenant(session, "acme")
        other = await add_tenant(session, "globex")
        past = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)
        keys = {"salted": await add_key(session, tenant.id),
                "seeded": tenant.api_key,
                "expired": await add_key(session, tenant.id, expires_at=past),
                "revoked": await add_key(session, tenant.id, revoked_at=past),
                "finance": await add_key(session, None, KeyScope.FINANCE),
                "admin": await add_key(session, None, KeyScope.ADMIN),
                "stranger": other.api_key}
    run_id = (await api.submit(tenant, prompt_of(4), 4)).run_id
    await set_run(api.sessionmaker, run_id, status="COMPLETED", terminal_sequence=3)

    async def outcome(call: str, key: str, about: str = run_id) -> str:
        method = getattr(runs.stub, call)
        request = runs_pb2.GetRunRequest(run_id=about) if call == "GetRun" else \
            runs_pb2.CancelRequest(run_id=about)
        try:
            answer = await method(request, metadata=(("x-api-key", key),))
        except grpc.aio.AioRpcError as error:
            return error.code().name
        return common_pb2.RunStatus.Name(answer.status)

    expected = {"salted": "RUN_STATUS_COMPLETED", "seeded": "RUN_STATUS_COMPLETED",
                "expired": "UNAUTHENTICATED", "revoked": "UNAUTHENTICATED", "finance": "PERMISSION_DENIED",
                "admin": "PERMISSION_DENIED", "stranger": "NOT_FOUND"}
    for call in ("GetRun", "Cancel"):
        assert {name: await outcome(call, key) for name, key in keys.items()} == expected, call
        assert await outcome(call, keys["seeded"], "not-a-run-id") == "NOT_FOUND"
        assert await outcome(call, keys["seeded"], str(uuid.uuid4())) == "NOT_FOUND"
        assert await outcome(call, "sk-nobody", "not-a-run-id") == "UNAUTHENTICATED"


async def test_get_run_is_one_statement_on_the_raw_pool_and_reports_usage_in_flight(
        api, runs: RunsApi, engine: AsyncEngine):  # type: ignore[no-untyped-def]
    async with api.sessionmaker() as session, session.begin():
        model = await add_model(session, api.tokenizer, DEFAULT_MODEL)
        tenant = await add_tenant(session, "acme")
    submitted = await api.submit(tenant, prompt_of(10), 8)
    await set_run(api.sessionmaker, submitted.run_id, status="RUNNING", replica="r0", output_tokens=3,
                  cached_input_tokens=4, last_sequence=2)
    metadata = (("x-api-key", tenant.api_key),)
    await runs.stub.GetRun(runs_pb2.GetRunRequest(run_id=submitted.run_id), metadata=metadata)  # key's use
    orm = record_statements(engine)
    runs.hot.seen.clear()
    run = await runs.stub.GetRun(runs_pb2.GetRunRequest(run_id=submitted.run_id), metadata=metadata)
    assert runs.hot.seen == ["SELECT k.id"] and orm == []
    # In flight: the prompt (10, 4 of them cached) and the 3 durable output tokens, at the model's rates.
    scaled = (6 * model.price_input_per_m_micros + 4 * model.price_cached_input_per_m_micros
              + 3 * model.price_output_per_m_micros)
    assert (run.status, run.replica, run.last_sequence) == (common_pb2.RUN_STATUS_RUNNING, "r0", 2)
    assert (run.usage.input_tokens, run.usage.cached_input_tokens, run.usage.output_tokens,
            run.usage.cost_micros) == (10, 4, 3, -(-scaled // 1_000_000))


async def test_cancelling_a_run_in_progress_is_one_update_that_notifies_its_worker(
        api, runs: RunsApi, engine: AsyncEngine, sessionmaker):  # type: ignore[no-untyped-def]
    async with api.sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, DEFAULT_MODEL)
        tenant = await add_tenant(session, "acme")
    run_id = (await api.submit(tenant, prompt_of(4), 4)).run_id
    await set_run(api.sessionmaker, run_id, status="RUNNING", replica="r0")
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = await asyncpg.connect(asyncpg_dsn(dsn_of(sessionmaker)))
    await listener.add_listener(CANCEL_CHANNEL, lambda _c, _p, _ch, payload: heard.put_nowait(payload))
    metadata = (("x-api-key", tenant.api_key),)
    try:
        await runs.stub.GetRun(runs_pb2.GetRunRequest(run_id=run_id), metadata=metadata)   # key's use
        orm = record_statements(engine)
        runs.hot.seen.clear()
        answer = await runs.stub.Cancel(runs_pb2.CancelRequest(run_id=run_id), metadata=metadata)
        assert answer.status == common_pb2.RUN_STATUS_RUNNING          # it ends when its worker stops it
        assert runs.hot.seen == ["SELECT k.id", "UPDATE runs"] and orm == []
        assert await asyncio.wait_for(heard.get(), 5.0) == run_id
        assert (await get_run(api.sessionmaker, run_id)).cancel_requested_at is not None
        runs.hot.seen.clear()
        again = await runs.stub.Cancel(runs_pb2.CancelRequest(run_id=run_id), metadata=metadata)
        assert again.status == common_pb2.RUN_STATUS_RUNNING and runs.hot.seen == ["SELECT k.id"]
        assert heard.empty()
    finally:
        await listener.close()
