"""The HTTP edge's seed 002 door carries the priority class (issue 14 point 4): `priority: "batch"`
on POST /v1/inference, refused 403 to a tenant not permitted batch, shown on the 202 answer."""

from __future__ import annotations

import pytest
from sluice.ledger.models import Run, Tenant
from sluice.services.errors import BATCH_NOT_ALLOWED
from sqlalchemy import select, update

from tests.support.edge_stack import Edge, bearer
from tests.support.ledger_factories import ModelSpec, add_model, add_tenant

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
