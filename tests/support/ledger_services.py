"""Admission and Usage served in-process on a free port, called through the generated stubs.

    pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]

    async def test_something(api): ...
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest
from sluice.services.admission import AdmissionService, add_admission_servicer
from sluice.services.usage import add_usage_servicer
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.config import Settings, load_settings
from sluice.v1 import admission_pb2, admission_pb2_grpc, usage_pb2, usage_pb2_grpc
from tests.support.ledger_factories import TenantHandle, build_word_tokenizer


def key_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("x-api-key", api_key),)


@dataclass(frozen=True, slots=True)
class Services:
    sessionmaker: async_sessionmaker[AsyncSession]
    admission: admission_pb2_grpc.AdmissionStub
    usage: usage_pb2_grpc.UsageServiceStub
    tokenizer: str                   # path of the word-level test tokenizer
    service: AdmissionService | None = None   # the in-process service behind `admission` (its metrics)

    async def submit(
        self,
        tenant: TenantHandle,
        prompt: str | bytes,
        max_output_tokens: int,
        *,
        request_key: str | None = None,
        model: str = "test",
        deadline_ms: int = 0,
        temperature: float = 0.0,
        metadata: tuple[tuple[str, str], ...] | None = None,
        priority: int = 0,
    ) -> admission_pb2.SubmitResponse:
        request = admission_pb2.SubmitRequest(
            model=model,
            input=prompt.encode("utf-8") if isinstance(prompt, str) else prompt,
            max_output_tokens=max_output_tokens,
            request_key=uuid.uuid4().hex if request_key is None else request_key,
            deadline_ms=deadline_ms,
            sampling=admission_pb2.SamplingParams(temperature=temperature),
            priority=priority,      # type: ignore[arg-type]
        )
        return await self.admission.Submit(
            request, metadata=key_metadata(tenant.api_key) if metadata is None else metadata
        )

    async def usage_report(self, tenant: TenantHandle, from_date: str = "",
                           to_date: str = "") -> usage_pb2.GetUsageResponse:
        request = usage_pb2.GetUsageRequest(from_date=from_date, to_date=to_date)
        return await self.usage.GetUsage(request, metadata=key_metadata(tenant.api_key))


@pytest.fixture(scope="session")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_word_tokenizer(Path(tmp_path_factory.mktemp("tokenizer")) / "words.json")


@pytest.fixture
async def api(sessionmaker: async_sessionmaker[AsyncSession], word_tokenizer: str) -> AsyncIterator[Services]:
    async with serve_ledger(sessionmaker, word_tokenizer, load_settings()) as services:
        yield services


@contextlib.asynccontextmanager
async def serve_ledger(sessionmaker: async_sessionmaker[AsyncSession], word_tokenizer: str,
                       config: Settings) -> AsyncIterator[Services]:
    """Admission + Usage on a free loopback port with `config` (e.g. tighter [admission] keys)."""
    server = grpc.aio.server()
    service = add_admission_servicer(server, sessionmaker, config)
    add_usage_servicer(server, sessionmaker, config)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Services(
            sessionmaker=sessionmaker,
            admission=admission_pb2_grpc.AdmissionStub(channel),
            usage=usage_pb2_grpc.UsageServiceStub(channel),
            tokenizer=word_tokenizer,
            service=service,
        )
    finally:
        await channel.close()
        await server.stop(None)
        await service.close()
