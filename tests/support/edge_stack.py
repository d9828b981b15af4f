"""The HTTP edge on top of the routing stack, for tests that speak real HTTP.

    async def test_something(edge): ...   # edge.url, edge.stack, edge.openai(api_key)

The edge gets its own Admission/Runs/Usage service objects over the stack's database and event
log, exactly as services/main.py builds them for the gateway, served by uvicorn on a free port in
the test's event loop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI
from openai._models import construct_type
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from sluice.services.admission import AdmissionService, AdmissionSettings
from sluice.services.edge.server import EdgeServer
from sluice.services.edge.settings import HttpSettings
from sluice.services.edge.templates import ModelCards
from sluice.services.edge.web import EdgeServices
from sluice.services.runs import RunsService
from sluice.services.usage import UsageQueryService

from tests.support.routing_stack import Stack


def _import_openai_resources() -> None:
    """The client imports its resource modules and builds its event-union parsers on first use
    (over a second of CPU on this box). Done here, at collection, rather than inside a test, where
    it would stall the event loop the test's routing worker shares long enough to cost a run its
    lease."""
    client = AsyncOpenAI(api_key="sk-import-only", base_url="http://127.0.0.1:9/v1")
    assert client.chat.completions and client.completions and client.responses and client.models
    for kind, sample in ((ResponseStreamEvent, {"type": "response.queued", "sequence_number": 0}),
                         (Response, {"id": "resp_0", "status": "queued", "output": []}),
                         (ChatCompletionChunk, {"id": "c", "choices": []})):
        construct_type(type_=kind, value=sample)


_import_openai_resources()


@dataclass(slots=True)
class Edge:
    stack: Stack
    url: str                          # http://127.0.0.1:<port>
    http: aiohttp.ClientSession

    def openai(self, api_key: str) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)


def bearer(api_key: str, **extra: str) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}", **extra}


@dataclass(frozen=True, slots=True)
class SseEvent:
    id: int | None
    event: str | None
    data: Any                         # parsed JSON, or the raw text ("[DONE]")


async def sse_events(response: aiohttp.ClientResponse, limit: int | None = None) -> list[SseEvent]:
    """Read SSE messages until the stream ends (or `limit` messages)."""
    events: list[SseEvent] = []
    async for event in iter_sse(response):
        events.append(event)
        if limit is not None and len(events) == limit:
            break
    return events


async def iter_sse(response: aiohttp.ClientResponse) -> AsyncIterator[SseEvent]:
    fields: dict[str, str] = {}
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line:
            name, _, value = line.partition(": ")
            fields[name] = value
            continue
        if "data" in fields:
            data = fields["data"]
            yield SseEvent(int(fields["id"]) if "id" in fields else None, fields.get("event"),
                           data if data == "[DONE]" else json.loads(data))
        fields = {}


# These tests never let a lease run out, and their client (the openai package parses every chunk
# with pydantic) shares the event loop with the in-process routing worker: on a loaded 2-core box
# a 3 s lease can lapse under them and end a healthy run INTERRUPTED. Lease expiry has its own tests.
EDGE_LEASE_SECONDS = 15


@pytest.fixture
async def edge(stack: Stack) -> AsyncIterator[Edge]:
    stack.config = stack.config.updated(routing={"lease_seconds": EDGE_LEASE_SECONDS})
    config = stack.config
    settings = HttpSettings.from_config(config.updated(http={"listen": "127.0.0.1:0"}))
    runs = RunsService(stack.sessionmaker, stack.events, EDGE_LEASE_SECONDS, dsn=config.database.url)
    admission = AdmissionService(stack.sessionmaker, AdmissionSettings.from_config(config))
    services = EdgeServices(admission, runs,
                            UsageQueryService(stack.sessionmaker), stack.sessionmaker,
                            ModelCards(stack.sessionmaker, settings.model_card_ttl_s), settings)
    server = EdgeServer(services)
    await server.start()
    http = aiohttp.ClientSession()
    try:
        yield Edge(stack, server.address, http)
    finally:
        await http.close()
        await server.stop()
        await runs.close()
        await admission.close()
