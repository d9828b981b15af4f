"""The HTTP edge's seed 002 door carries the priority class (issue 14 point 4): `priority: "batch"`
on POST /v1/inference, refused 403 to a tenant not permitted batch, shown on the 202 answer; and
the request's fallback narrowing (point 2), with the routing decision on the answer and the run."""

from __future__ import annotations

import pytest
from sluice.ledger.fallbacks import FallbackAdmin
from sluice.ledger.models import Run, Tenant
from sluice.services.errors import BATCH_NOT_ALLOWED
from sqlalchemy import select, update

from sluice.traffic.fallback import Condition, FallbackRule
from tests.support.edge_stack import Edge, bearer
from tests.support.ledger_factories import ModelSpec, add_model, add_tenant
from tests.support.routing_stack import MODEL, TOKENIZER, Stack
from tests.test_traffic_fallback import SMALL

pytestmark = pytest.mark.integration


async def test_a_batch_inference_needs_the_tenants_permission_and_is_recorded_batch(edge: Edge,
                                                                                    word_tokenizer: str):
    stack = edge.stack
    async with stack.sessionmaker() as session, session.begin():
        await add_model(session, word_tokenizer, ModelSpec())
        tenant = await add_tenant(session, "initech")
    body = {"model": "test", "input": "alpha bravo", "maxOutputTokens": 4, "requestKey": "b-1",
            "priority": "batch"}

    async with edge.http.post(f"{edge.url}/v1/inference", headers=bearer(tenant.api_key), json=body) as reply:
        refused, error = reply.status, (await reply.json())["error"]
    async with stack.sessionmaker() as session, session.begin():
        await session.execute(update(Tenant).where(Tenant.id == tenant.id).values(batch_allowed=True))
    async with edge.http.post(f"{edge.url}/v1/inference", headers=bearer(tenant.api_key), json=body) as reply:
        accepted, answer = reply.status, await reply.json()
    async with edge.http.post(f"{edge.url}/v1/inference", headers=bearer(tenant.api_key),
                              json={**body, "priority": "urgent"}) as reply:
        unknown = reply.status

    assert (refused, error["message"]) == (403, BATCH_NOT_ALLOWED)
    assert (accepted, answer["priority"]) == (202, "batch")
    assert unknown == 400
    async with stack.sessionmaker() as session:
        priority = await session.scalar(select(Run.priority).where(Run.request_key == "b-1"))
    assert priority == "batch"


@pytest.fixture
async def one_waiting_run_per_pool(stack: Stack) -> None:
    """Room for ONE waiting run per pool (no routing worker runs), and a smaller model to fall back
    to; requested before `edge`, which reads the admission settings when it starts."""
    async with stack.sessionmaker() as session, session.begin():
        await add_model(session, TOKENIZER, SMALL)
    stack.config = stack.config.updated(admission={"max_backlog_per_pool": 1})


async def test_the_http_door_narrows_a_permitted_fallback_and_shows_the_decision(one_waiting_run_per_pool,
                                                                                  edge: Edge):
    stack, key = edge.stack, edge.stack.tenant.api_key
    url = f"{edge.url}/v1/inference"

    async def post(request_key: str, **extra: object) -> tuple[int, dict]:
        body = {"model": "chat", "input": "Tell me about sluice gates.", "maxOutputTokens": 8,
                "requestKey": request_key, **extra}
        async with edge.http.post(url, headers=bearer(key), json=body) as reply:
            return reply.status, await reply.json()

    waiting = await post("f-0")                        # fills the big pool's backlog (1 of 1)
    async with stack.sessionmaker() as session, session.begin():
        await FallbackAdmin(session).replace(stack.tenant.id, [
            FallbackRule("chat", SMALL.version, frozenset({Condition.BACKLOG}))])
    refused = await post("f-1", fallback={"refuse": True})
    other_condition = await post("f-2", fallback={"conditions": ["deadline"]})
    other_model = await post("f-3", fallback={"models": ["some-other-model"]})
    unknown_condition = await post("f-4", fallback={"conditions": ["whenever"]})
    taken = await post("f-5", fallback={"models": [SMALL.version], "conditions": ["backlog"]})

    assert waiting[0] == 202 and waiting[1]["route"]["reason"] == "alias"
    assert [refused[0], other_condition[0], other_model[0]] == [503, 503, 503]
    assert unknown_condition[0] == 400
    status, answer = taken
    assert status == 202 and answer["modelVersion"] == SMALL.version
    assert answer["route"] == {"modelVersion": SMALL.version, "pool": SMALL.version, "tier": "standard",
                               "reason": "fallback", "requestedModel": "chat", "fallbackFrom": MODEL.version,
                               "detail": f"backlog: {MODEL.version} backlog 1 >= 1"}
    async with edge.http.get(f"{edge.url}/v1/runs/{answer['runId']}", headers=bearer(key)) as reply:
        assert (await reply.json())["route"] == answer["route"]
