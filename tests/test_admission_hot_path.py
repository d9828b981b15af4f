"""Submit's hot path on the real PostgreSQL: how many statements a Submit costs, and on which kind
of connection. What it decides is pinned by the other
test_admission_* files, which run through the same code."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import asyncpg
import grpc.aio
import pytest
from sluice.ledger.pg import HotPool
from sluice.services import errors
from sluice.services.submit_contexts import SubmitContexts
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from tests.support.ledger_factories import DEFAULT_MODEL, add_model, add_tenant, budget_row, prompt_of

if TYPE_CHECKING:
    from tests.support.ledger_services import Services

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]
pytestmark = pytest.mark.integration


def record_statements(engine: AsyncEngine) -> list[tuple[str, Any]]:
    """(first words of the SQL, the connection's isolation level) of every SQLAlchemy statement
    from now on."""
    seen: list[tuple[str, Any]] = []

    def before(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        isolation = conn.get_execution_options().get("isolation_level")
        seen.append((" ".join(statement.split()[:2]), isolation))

    event.listen(engine.sync_engine, "before_cursor_execute", before)
    return seen


class RecordingPool:
    """The service's raw asyncpg pool, recording the first words of every statement run on it
    (BEGIN and COMMIT included: asyncpg sends them as statements too)."""

    def __init__(self, pool: HotPool) -> None:
        self.pool = pool
        self.seen: list[str] = []

    def _logged(self, query: asyncpg.connection.LoggedQuery) -> None:
        self.seen.append(" ".join(query.query.split()[:2]))

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        async with self.pool.connection() as connection:
            connection.add_query_logger(self._logged)
            try:
                yield connection
            finally:
                connection.remove_query_logger(self._logged)

    async def close(self) -> None:
        await self.pool.close()


def record_hot_statements(api: Services) -> RecordingPool:
    assert api.service is not None
    recording = RecordingPool(api.service.hot)
    api.service.hot = recording   # type: ignore[assignment]
    return recording


async def setup(api: Services, **tenant: Any):  # type: ignore[no-untyped-def]
    async with api.sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, DEFAULT_MODEL)
        return await add_tenant(session, "acme", **tenant)


async def test_a_submit_without_tenant_limits_is_two_statements_then_one_on_the_raw_pool(api: Services,
                                                                                         engine: AsyncEngine):
    """The first Submit of a key to a model reads its context and writes; the next ones are decided on
    that context (services/submit_contexts.py) and only write, the write checking it still holds."""
    tenant = await setup(api)
    await api.submit(tenant, prompt_of(10), 5)           # warm: pool, prepared statements, type codecs
    assert api.service is not None
    api.service._contexts = SubmitContexts()             # ... but no context kept yet
    orm = record_statements(engine)
    hot = record_hot_statements(api)
    await api.submit(tenant, prompt_of(10), 5)
    assert hot.seen == ["SELECT t.id", "WITH reserved"]   # no BEGIN/COMMIT: each is its own transaction
    hot.seen.clear()
    await api.submit(tenant, prompt_of(10), 5)
    assert hot.seen == ["WITH counted"]                   # the held write alone
    assert orm == []
    budget = await budget_row(api.sessionmaker, tenant.id)
    assert budget.reserved_tokens == 3 * (10 + 5)


async def test_a_retry_of_an_accepted_submit_falls_back_to_the_transaction_and_reserves_nothing_more(
        api: Services, engine: AsyncEngine):
    tenant = await setup(api)
    first = await api.submit(tenant, prompt_of(10), 5, request_key="k1")
    orm = record_statements(engine)
    hot = record_hot_statements(api)
    again = await api.submit(tenant, prompt_of(10), 5, request_key="k1")
    assert again.run_id == first.run_id and again.deduplicated
    # The held write is refused by the unique index (rolled back whole); the key is then authenticated
    # by a fresh read before the idempotent answer: the write tried again, refused again, rolled back.
    assert hot.seen == ["WITH counted", "SELECT t.id", "WITH reserved"]
    assert orm and all(isolation is None for _, isolation in orm)   # then the transactional path
    assert (await budget_row(api.sessionmaker, tenant.id)).reserved_tokens == 10 + 5


async def test_a_budget_refusal_after_the_held_write_stands_without_a_fresh_read(api: Services,
                                                                                 engine: AsyncEngine):
    """A Submit decided on a kept context whose write found that context holding but the budget
    short: the transactional path's refusal is the answer, not decided again on a fresh read (a
    tenant out of budget would otherwise cost twice the statements on every Submit)."""
    tenant = await setup(api, token_budget=20)
    await api.submit(tenant, prompt_of(10), 5)            # 15 of 20 reserved; the context kept
    hot = record_hot_statements(api)
    orm = record_statements(engine)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.submit(tenant, prompt_of(10), 5)        # 15 more do not fit
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert hot.seen == ["WITH counted"]                   # held, nothing reserved; no read after it
    assert orm                                            # the transactional path told why
    assert (await budget_row(api.sessionmaker, tenant.id)).reserved_tokens == 15


async def test_a_hot_connection_lost_mid_submit_is_unavailable_and_the_next_submit_reconnects(
        api: Services):
    """The raw pool's connection errors are the database's, not bugs: UNAVAILABLE with a retry delay
    (INTERNAL before services/errors.py knew asyncpg's). The WRITE is held on the budget row's lock
    while its backend is terminated, so the connection dies in the middle of the statement."""
    tenant = await setup(api)
    await api.submit(tenant, prompt_of(10), 5)
    async with api.sessionmaker() as session, session.begin():
        await session.execute(text("SELECT 1 FROM budgets WHERE tenant_id = :t FOR UPDATE"), {"t": tenant.id})
        submit = asyncio.ensure_future(api.submit(tenant, prompt_of(10), 5))
        terminated = await terminate_backends_waiting_in(session, "WITH reserved")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await submit
    assert terminated == 1
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.UNAVAILABLE,
                                                             errors.DATABASE_UNAVAILABLE)
    retry_after = (errors.RETRY_AFTER_MS_KEY, str(errors.DATABASE_RETRY_AFTER_MS))
    assert retry_after in tuple(caught.value.trailing_metadata())
    await api.submit(tenant, prompt_of(10), 5)             # the pool replaced the dead connection
    assert (await budget_row(api.sessionmaker, tenant.id)).reserved_tokens == 2 * (10 + 5)


async def terminate_backends_waiting_in(session: AsyncSession, statement: str) -> int:
    """Terminate the backends that wait on a lock in this database (only the Submit's WRITE takes
    the budget row this session holds). Not found by its query text: pg_stat_activity may still show
    the connection's previous statement (the READ) while a prepared statement's execution waits."""
    for _ in range(200):
        pids = (await session.scalars(text(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            " AND pid <> pg_backend_pid()"))).all()
        if pids:
            for pid in pids:
                await session.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            return len(pids)
        await asyncio.sleep(0.05)
    raise AssertionError(f"no backend waited in {statement!r}")
