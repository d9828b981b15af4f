"""ledger/pg.KnownTypesConnection: asyncpg's catalog lookup of a statement's types (~7 ms of
PostgreSQL CPU each) runs once per process for PostgreSQL's own types, not once per connection."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest
from sluice.ledger import pg
from sluice.ledger.pg import HotPool, KnownTypesConnection

pytestmark = pytest.mark.integration
pytest_plugins = ["tests.support.db"]

# Binds uuid[], bigint[] and text[]: types asyncpg looks up in the catalog before it can encode them.
ARRAYS = ("SELECT cardinality(CAST($1 AS uuid[])) + cardinality(CAST($2 AS bigint[]))"
          " + cardinality(CAST($3 AS text[]))")


async def test_a_new_connection_reuses_the_types_an_earlier_one_looked_up(
        database_dsn: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(KnownTypesConnection, "_types", {})
    looked_up: list[list[int]] = []
    original = asyncpg.Connection._introspect_types

    async def counted(self: asyncpg.Connection, typeoids: Any, limit: Any) -> Any:
        looked_up.append(sorted(typeoids))
        return await original(self, typeoids, limit)
    monkeypatch.setattr(asyncpg.Connection, "_introspect_types", counted)
    answers = []
    for _ in range(2):                  # two pools: two fresh connections
        pool = HotPool(database_dsn)
        try:
            async with pool.connection() as connection:
                assert isinstance(connection, KnownTypesConnection)
                answers.append(await connection.fetchval(ARRAYS, [uuid.uuid4()], [1, 2], ["a", "b", "c"]))
        finally:
            await pool.close()
    assert answers == [6, 6]
    assert len(looked_up) == 1          # the second connection asked the catalog nothing
    assert set(looked_up[0]) <= set(KnownTypesConnection._types)
    assert all(oid < pg._FIRST_NORMAL_OID for oid in KnownTypesConnection._types)


async def test_a_statement_prepared_now_and_run_later_runs_at_its_own_time(
        database_dsn: str, monkeypatch: pytest.MonkeyPatch):
    """asyncpg's prepare leaves PostgreSQL's implicit transaction open (Flush, no Sync) unless a type
    lookup follows; with the types cached nothing did, and the statement run later saw now() frozen
    at the prepare (the lease keeper renewed leases into the past)."""
    monkeypatch.setattr(KnownTypesConnection, "_types", {})
    idle_s = 1.0
    lags = []
    for _ in range(2):                  # the first connection looks the types up, the second reuses them
        connection = await asyncpg.connect(pg.asyncpg_dsn(database_dsn),
                                           connection_class=KnownTypesConnection)
        try:
            statement = await connection.prepare("SELECT clock_timestamp() - now() AS lag, "
                                                 "cardinality(CAST($1 AS uuid[])) AS n")
            await asyncio.sleep(idle_s)
            row = await statement.fetchrow([uuid.uuid4()])
            lags.append(row["lag"].total_seconds())
            assert row["n"] == 1
        finally:
            await connection.close()
    # Run after the idle second, in a transaction of its own: now() is within the statement, far
    # from the prepare a second before.
    assert all(lag < idle_s / 2 for lag in lags), lags
