"""Submit's hot path on the real PostgreSQL: how many statements a Submit costs, and on which kind
of connection. What it decides is pinned by the other
test_admission_* files, which run through the same code."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.ledger_factories import DEFAULT_MODEL, add_model, add_tenant, budget_row, prompt_of

if TYPE_CHECKING:
    from tests.support.ledger_services import Services

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]
pytestmark = pytest.mark.integration


def record_statements(engine: AsyncEngine) -> list[tuple[str, Any]]:
    """(first words of the SQL, the connection's isolation level) of every statement from now on."""
    seen: list[tuple[str, Any]] = []

    def before(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        isolation = conn.get_execution_options().get("isolation_level")
        seen.append((" ".join(statement.split()[:2]), isolation))

    event.listen(engine.sync_engine, "before_cursor_execute", before)
    return seen


async def setup(api: Services, **tenant: Any):  # type: ignore[no-untyped-def]
    async with api.sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, DEFAULT_MODEL)
        return await add_tenant(session, "acme", **tenant)


async def test_a_submit_without_tenant_limits_is_two_autocommit_statements(api: Services,
                                                                           engine: AsyncEngine):
    tenant = await setup(api)
    await api.submit(tenant, prompt_of(10), 5)           # warm: pool, prepared statements
    seen = record_statements(engine)
    await api.submit(tenant, prompt_of(10), 5)
    assert seen == [("SELECT t.id", "AUTOCOMMIT"), ("WITH reserved", "AUTOCOMMIT")]
    budget = await budget_row(api.sessionmaker, tenant.id)
    assert budget.reserved_tokens == 2 * (10 + 5)


async def test_a_retry_of_an_accepted_submit_falls_back_to_the_transaction_and_reserves_nothing_more(
        api: Services, engine: AsyncEngine):
    tenant = await setup(api)
    first = await api.submit(tenant, prompt_of(10), 5, request_key="k1")
    seen = record_statements(engine)
    again = await api.submit(tenant, prompt_of(10), 5, request_key="k1")
    assert again.run_id == first.run_id and again.deduplicated
    assert seen[1][0] == "WITH reserved"                 # tried, refused by the unique index, rolled back
    assert all(isolation is None for _, isolation in seen[2:])   # then the transactional path
    assert (await budget_row(api.sessionmaker, tenant.id)).reserved_tokens == 10 + 5
