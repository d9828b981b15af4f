"""Permitted fallback and the routing decision on the run, on the real stack (PostgreSQL, Kafka,
Triton replicas): a run goes to a smaller model only when the tenant's administrator permits it
and the request does not narrow it away; the caller sees it on the submit answer, GetRun, the
first STATUS event of the stream, the usage entry and the routing metrics; it is priced at the
fallback's card.

Admission is served with room for ONE waiting run per pool, and no routing worker runs until the
submits are done, so the first run on `chat` fills the big pool's backlog and the next is shed.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest
from sluice.ledger.fallbacks import FallbackAdmin
from sluice.ledger.models import Run, UsageEntry
from sluice.ledger.pricing import TOKENS_PER_PRICE_UNIT
from sluice.services.admission import add_admission_servicer
from sluice.services.errors import RETRY_AFTER_MS_KEY
from sqlalchemy import select

from sluice.traffic.fallback import Condition, FallbackRule
from sluice.v1 import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    runs_pb2,
    runs_pb2_grpc,
    usage_pb2,
    usage_pb2_grpc,
)
from tests.support.ledger_factories import ModelSpec, add_model
from tests.support.routing_stack import MODEL, TOKENIZER, Stack, collect

pytestmark = pytest.mark.integration

# The fallback: the same tokenizer, a tenth of the big model's prices.
SMALL = ModelSpec(version="tiny-chat-small", alias="chat-small", context_limit=4096,
                  price_input_per_m_micros=50_000, price_cached_input_per_m_micros=5_000,
                  price_output_per_m_micros=150_000)
PROMPT = "Tell me about sluice gates."
CAP = 16


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Door:
    """Admission with one waiting run allowed per pool, on its own port."""

    def __init__(self, stack: Stack, stub: admission_pb2_grpc.AdmissionStub) -> None:
        self.stack = stack
        self.stub = stub

    async def submit(self, api_key: str, fallback: admission_pb2.FallbackRequest | None = None,
                     model: str = "chat") -> admission_pb2.SubmitResponse:
        request = admission_pb2.SubmitRequest(model=model, input=PROMPT.encode(), max_output_tokens=CAP,
                                              request_key=uuid.uuid4().hex, fallback=fallback)
        return await self.stub.Submit(request, metadata=(("x-api-key", api_key),))

    async def shed(self, api_key: str, fallback: admission_pb2.FallbackRequest | None = None) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await self.submit(api_key, fallback)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
        assert int(dict(caught.value.trailing_metadata() or ())[RETRY_AFTER_MS_KEY]) > 0


@pytest.fixture
async def door(stack: Stack) -> AsyncIterator[Door]:
    async with stack.sessionmaker() as session, session.begin():
        await add_model(session, TOKENIZER, SMALL)
    # r0 serves the big model's pool, r1 the fallback's.
    tables = stack.config.replica_tables()
    tables[0]["pool"], tables[1]["pool"] = MODEL.version, SMALL.version
    stack.config = stack.config.updated(admission={"max_backlog_per_pool": 1}, replicas=tables)
    server = grpc.aio.server()
    admission = add_admission_servicer(server, stack.sessionmaker, stack.config)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Door(stack, admission_pb2_grpc.AdmissionStub(channel))
    finally:
        await channel.close()
        await server.stop(None)
        await admission.close()


async def permit(stack: Stack, tenant_id: uuid.UUID, *rules: FallbackRule) -> None:
    async with stack.sessionmaker() as session, session.begin():
        await FallbackAdmin(session).replace(tenant_id, rules)


async def test_a_fallback_is_taken_only_with_permission_recorded_on_the_run_and_priced_at_its_card(
        door: Door, stack: Stack):
    key = stack.tenant.api_key
    waiting = await door.submit(key)                  # fills the big pool's backlog (1 of 1)
    assert waiting.route.reason == common_pb2.ROUTE_REASON_ALIAS
    assert (waiting.route.model_version, waiting.route.pool) == (MODEL.version, MODEL.version)

    await door.shed(key)                               # no permission yet: UNAVAILABLE + retry-after
    await permit(stack, stack.tenant.id, FallbackRule("chat", SMALL.version, frozenset({Condition.BACKLOG})))
    await door.shed(key, admission_pb2.FallbackRequest(refuse=True))          # the request narrows it away
    await door.shed(key, admission_pb2.FallbackRequest(                      # ... or keeps another condition
        conditions=[admission_pb2.FALLBACK_CONDITION_DEADLINE]))
    await door.shed(key, admission_pb2.FallbackRequest(models=["some-other-model"]))
    await door.shed(stack.other.api_key)               # another tenant has no permission

    taken = await door.submit(key, admission_pb2.FallbackRequest(models=[SMALL.version]))
    route = taken.route
    assert taken.model_version == SMALL.version
    assert (route.reason, route.model_version, route.pool, route.tier) == (
        common_pb2.ROUTE_REASON_FALLBACK, SMALL.version, SMALL.version, "standard")
    assert (route.requested_model, route.fallback_from) == ("chat", MODEL.version)
    assert route.detail == f"backlog: {MODEL.version} backlog 1 >= 1"
    # Reserved at the fallback's card: every prompt token at its input rate, the whole cap at its output rate.
    row = await stack.run_row(taken.run_id)
    assert row.reserved_cost_micros == ceil_div(
        taken.input_tokens * SMALL.price_input_per_m_micros + CAP * SMALL.price_output_per_m_micros,
        TOKENS_PER_PRICE_UNIT)

    worker = await stack.start_worker()
    events = await collect(stack_client_stream(stack, taken.run_id))
    assert events[0].type == runs_pb2.EVENT_TYPE_STATUS
    assert events[0].route == route                    # the first STATUS event carries the decision
    assert all(not e.HasField("route") for e in events[1:])
    ended = await stack.wait_for_published(taken.run_id)
    assert ended.replica == "r1"                       # the fallback's pool

    got = await runs_stub(stack).GetRun(runs_pb2.GetRunRequest(run_id=taken.run_id),
                                        metadata=(("x-api-key", key),))
    assert got.route == route
    entry = await usage_entry(stack, taken.run_id)
    assert (entry.model_version, entry.route_reason, entry.worker_pool, entry.quality_tier) == (
        SMALL.version, "fallback", SMALL.version, "standard")
    charged = (entry.input_tokens - entry.cached_input_tokens) * SMALL.price_input_per_m_micros \
        + entry.cached_input_tokens * SMALL.price_cached_input_per_m_micros \
        + entry.output_tokens * SMALL.price_output_per_m_micros
    assert entry.output_tokens == CAP
    assert entry.cost_micros == ceil_div(charged, TOKENS_PER_PRICE_UNIT)

    await stack.wait_for_published(waiting.run_id)
    # Finance's export groups settled usage by the decision.
    query = usage_pb2.QueryUsageRequest(to="2100-01-01", group_by=["route", "pool", "tier"])
    setattr(query, "from", "2000-01-01")   # `from` is a Python keyword
    usage = usage_pb2_grpc.UsageServiceStub(stack.channel)
    page = await usage.QueryUsage(query, metadata=(("x-api-key", key),))
    assert {(g.route, g.pool, g.tier): (g.runs, g.settled.cost_micros) for g in page.groups} == {
        ("alias", MODEL.version, "standard"): (1, (await usage_entry(stack, waiting.run_id)).cost_micros),
        ("fallback", SMALL.version, "standard"): (1, entry.cost_micros)}
    registry = worker.metrics.registry
    assert registry.get_sample_value("sluice_run_routes_total", {
        "model_version": SMALL.version, "pool": SMALL.version, "tier": "standard", "reason": "fallback"}) == 1
    assert registry.get_sample_value("sluice_run_routes_total", {
        "model_version": MODEL.version, "pool": MODEL.version, "tier": "standard", "reason": "alias"}) == 1


async def test_a_fallback_outside_the_tenants_tiers_is_not_taken(door: Door, stack: Stack):
    async with stack.sessionmaker() as session, session.begin():
        await add_model(session, TOKENIZER, ModelSpec(version="tiny-chat-premium", alias=None,
                                                      context_limit=4096, quality_tier="premium"))
    await permit(stack, stack.tenant.id,
                 FallbackRule("chat", "tiny-chat-premium", frozenset({Condition.BACKLOG})))
    await door.submit(stack.tenant.api_key)
    await door.shed(stack.tenant.api_key)              # permitted, but the tenant may not use premium


def runs_stub(stack: Stack) -> runs_pb2_grpc.RunsStub:
    return runs_pb2_grpc.RunsStub(stack.channel)


def stack_client_stream(stack: Stack, run_id: str) -> AsyncIterator[runs_pb2.RunEvent]:
    return runs_stub(stack).Stream(runs_pb2.StreamRequest(run_id=run_id),  # type: ignore[no-any-return]
                                   metadata=(("x-api-key", stack.tenant.api_key),))


async def usage_entry(stack: Stack, run_id: str) -> UsageEntry:
    async with stack.sessionmaker() as session:
        entry = await session.scalar(select(UsageEntry).where(UsageEntry.run_id == uuid.UUID(run_id)))
        assert entry is not None
        assert await session.get(Run, uuid.UUID(run_id)) is not None
        return entry
