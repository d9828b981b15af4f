"""A gateway in-process (Admission, Usage, Admin) for the admin and finance tests, with an
admin-scoped key made the way the Admin API makes keys (salted, ledger/admin.KeyAdmin).

    async def test_something(gateway): ...
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
from sluice.ledger.admin import KeyAdmin
from sluice.ledger.models import KeyScope
from sluice.services.admin_servicer import add_admin_servicer
from sluice.services.admission import add_admission_servicer
from sluice.services.usage import add_usage_servicer
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import load_settings
from sluice.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc, usage_pb2_grpc
from tests.support.ledger_factories import MICROS
from tests.support.ledger_services import key_metadata


@dataclass(frozen=True, slots=True)
class Gateway:
    sessionmaker: async_sessionmaker[AsyncSession]
    address: str
    admission: admission_pb2_grpc.AdmissionStub
    usage: usage_pb2_grpc.UsageServiceStub
    admin: admin_pb2_grpc.AdminStub
    admin_key: str
    tokenizer: str

    @property
    def as_admin(self) -> tuple[tuple[str, str], ...]:
        return key_metadata(self.admin_key)

    async def tenant(
        self, name: str, token_budget: int = 1_000_000, cost_budget_micros: int = 1_000 * MICROS
    ) -> str:
        """A new tenant with a budget, through the Admin API; returns a tenant key's secret."""
        await self.admin.CreateTenant(
            admin_pb2.CreateTenantRequest(
                name=name, token_budget=token_budget, cost_budget_micros=cost_budget_micros
            ),
            metadata=self.as_admin,
        )
        return await self.key(tenant=name)

    async def key(self, *, tenant: str = "", scope: str = "tenant") -> str:
        created = await self.admin.CreateApiKey(
            admin_pb2.CreateApiKeyRequest(tenant=tenant, scope=scope), metadata=self.as_admin
        )
        return str(created.secret)

    async def model(
        self, version: str, alias: str = "", prices: tuple[int, int, int] = (500_000, 50_000, 1_500_000)
    ) -> None:
        await self.admin.RegisterModel(
            admin_pb2.RegisterModelRequest(
                version=version,
                alias=alias,
                tokenizer=self.tokenizer,
                context_limit=16_384,
                end_id=1,
                price_input_per_m_micros=prices[0],
                price_cached_input_per_m_micros=prices[1],
                price_output_per_m_micros=prices[2],
            ),
            metadata=self.as_admin,
        )

    async def submit(
        self,
        api_key: str,
        prompt: str,
        cap: int,
        model: str = "chat",
        stub: admission_pb2_grpc.AdmissionStub | None = None,
    ) -> admission_pb2.SubmitResponse:
        request = admission_pb2.SubmitRequest(
            model=model, input=prompt.encode(), max_output_tokens=cap, request_key=uuid.uuid4().hex
        )
        return await (stub or self.admission).Submit(request, metadata=key_metadata(api_key))


async def make_admin_key(sessionmaker: async_sessionmaker[AsyncSession]) -> str:
    async with sessionmaker() as session, session.begin():
        _, secret = await KeyAdmin(session).create(None, KeyScope.ADMIN, "test admin", None)
    return secret


@pytest.fixture
async def gateway(
    sessionmaker: async_sessionmaker[AsyncSession], word_tokenizer: str
) -> AsyncIterator[Gateway]:
    config = load_settings()
    server = grpc.aio.server()
    admission = add_admission_servicer(server, sessionmaker, config)
    add_usage_servicer(server, sessionmaker, config)
    add_admin_servicer(server, sessionmaker, config)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    try:
        yield Gateway(
            sessionmaker=sessionmaker,
            address=address,
            admission=admission_pb2_grpc.AdmissionStub(channel),
            usage=usage_pb2_grpc.UsageServiceStub(channel),
            admin=admin_pb2_grpc.AdminStub(channel),
            admin_key=await make_admin_key(sessionmaker),
            tokenizer=word_tokenizer,
        )
    finally:
        await channel.close()
        await server.stop(None)
        await admission.close()
