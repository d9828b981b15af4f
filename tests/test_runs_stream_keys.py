"""Runs.Stream authenticates as every other tenant RPC does (DESIGN.md "Keys and scopes"), on its
own one-statement lookup (ledger/runs_sql.py): a salted key made by the Admin API streams its
tenant's runs; a revoked or expired key is UNAUTHENTICATED; a finance or admin key is
PERMISSION_DENIED (it is a valid key, for something else); another tenant's run is NOT_FOUND.

The run streamed is one whose terminal event the cursor already holds, so Stream answers from the
ledger alone and no event log is needed (the stub refuses to be read)."""

from __future__ import annotations

import contextlib
import datetime as dt
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
from sluice.ledger.keys import generate_key
from sluice.ledger.models import ApiKey, KeyScope, Run
from sluice.services.runs import RunsService, RunsServicer
from sluice.services.validation import FieldLimits, add_checked_service
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.v1 import runs_pb2, runs_pb2_grpc
from tests.support.ledger_factories import DEFAULT_MODEL, add_model, add_tenant, prompt_of

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]
pytestmark = pytest.mark.integration

TERMINAL_SEQUENCE = 3


class UnreadLog:
    """An event log that must not be read: every stream here ends from the ledger alone."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the event log was used ({name})")


@pytest.fixture
async def runs(sessionmaker: async_sessionmaker[AsyncSession]) -> AsyncIterator[runs_pb2_grpc.RunsStub]:
    async with serve_runs(RunsService(sessionmaker, UnreadLog(), lease_seconds=10.0)) as stub:  # type: ignore[arg-type]
        yield stub


@contextlib.asynccontextmanager
async def serve_runs(service: RunsService) -> AsyncIterator[runs_pb2_grpc.RunsStub]:
    """`service` on a free loopback port; closed on the way out."""
    server = grpc.aio.server()
    add_checked_service(server, runs_pb2.DESCRIPTOR.services_by_name["Runs"], RunsServicer(service),
                        FieldLimits())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield runs_pb2_grpc.RunsStub(channel)
    finally:
        await channel.close()
        await server.stop(None)
        await service.close()


@dataclass(frozen=True, slots=True)
class Keys:
    salted: str          # the tenant's, made as the Admin API makes keys
    expired: str
    revoked: str
    finance: str
    admin: str
    stranger: str        # another tenant's (unsalted, as seeded keys are)


async def add_key(session: AsyncSession, tenant_id: uuid.UUID | None, scope: KeyScope = KeyScope.TENANT,
                  expires_at: dt.datetime | None = None, revoked_at: dt.datetime | None = None) -> str:
    key = generate_key()
    session.add(ApiKey(id=uuid.uuid4(), tenant_id=tenant_id, key_hash=key.key_hash, key_prefix=key.prefix,
                       key_salt=key.salt, scope=scope.value, expires_at=expires_at, revoked_at=revoked_at))
    await session.flush()
    return key.secret


async def test_stream_takes_salted_keys_and_refuses_revoked_expired_and_out_of_scope_ones(api, runs):
    async with api.sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, DEFAULT_MODEL)
        tenant = await add_tenant(session, "acme")
        other = await add_tenant(session, "globex")
        past = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)
        keys = Keys(salted=await add_key(session, tenant.id),
                    expired=await add_key(session, tenant.id, expires_at=past),
                    revoked=await add_key(session, tenant.id, revoked_at=past),
                    finance=await add_key(session, None, KeyScope.FINANCE),
                    admin=await add_key(session, None, KeyScope.ADMIN),
                    stranger=other.api_key)
    run_id = (await api.submit(tenant, prompt_of(4), 4)).run_id
    async with api.sessionmaker() as session, session.begin():
        await session.execute(update(Run).where(Run.id == uuid.UUID(run_id))
                              .values(terminal_sequence=TERMINAL_SEQUENCE))

    async def outcome(key: str) -> str:
        request = runs_pb2.StreamRequest(run_id=run_id, after=TERMINAL_SEQUENCE)
        try:
            events = [event async for event in runs.Stream(request, metadata=(("x-api-key", key),))]
        except grpc.aio.AioRpcError as error:
            return error.code().name
        return f"OK {len(events)} events"

    assert {name: await outcome(getattr(keys, name)) for name in Keys.__dataclass_fields__} == {
        "salted": "OK 0 events", "expired": "UNAUTHENTICATED", "revoked": "UNAUTHENTICATED",
        "finance": "PERMISSION_DENIED", "admin": "PERMISSION_DENIED", "stranger": "NOT_FOUND"}
    assert await outcome(tenant.api_key) == "OK 0 events"          # the seeded, unsalted kind
