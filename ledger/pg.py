"""The run path's hot statements on raw asyncpg connections (issue 9: the ledger's cost per run).

SQLAlchemy costs ~230 us of client CPU per statement on top of asyncpg's ~60 us, and ~350 us more
per pool checkout (events, reset-on-return); a session transaction of one statement ~900 us. The
routing worker's claim, RUNNING, settlement and terminal writes run here instead: each statement
is written once with :name parameters (`Statement`) and runs either through a SQLAlchemy session
(`rows_of(session)`: the rare callers, Runs.Cancel and the reaper, inside their transactions) or on
a `HotPool` connection (`rows_of(connection)`), where asyncpg prepares it once per connection.

    pool = HotPool(dsn)                                  # one per process and event loop
    async with pool.connection() as connection, connection.transaction():
        row = await rows_of(connection).row(STATEMENT, {"run_id": run_id})
    await pool.close()

A released connection is not reset with a round trip (asyncpg's default runs RESET ALL and
friends): these statements leave no session state behind, and an open transaction is still rolled
back by asyncpg on release.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, cast

import asyncpg
from sqlalchemy import TextClause, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

# :name, but not a ::cast and not inside a word (a time literal such as '12:30' does not occur here).
_PARAMETER = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")
POOL_SIZE = 8    # hot connections per process; a driver waits for one rather than opening more
# Every statement of the run path reads by key (a primary key, a unique key, a partial index). A
# prepared statement keeps its generic plan until an ANALYZE invalidates it, and one planned while a
# table was small (a fresh ledger, a new tenant's budgets) scans it whole as it grows: on a growing
# ledger the RUNNING, settlement and published writes scanned runs ~1 time in 2 (issue 9). Scans are
# priced out, not forbidden (a table with no usable index is still read whole: models, by name or
# alias). Generic plans always: priced-out scans left the writes that take arrays of run ids
# (`id = ANY(...)`, ten ids assumed) dearer in their generic plan than in a plan for the one id
# given, so PostgreSQL planned them again at every execution (~140 us each). JIT off: a priced-out
# plan's cost would otherwise cross jit_above_cost and compile.
HOT_SETTINGS = {"enable_seqscan": "off", "plan_cache_mode": "force_generic_plan", "jit": "off"}


@dataclass(frozen=True, slots=True)
class Statement:
    """One SQL statement with :name parameters, in both drivers' forms."""

    named: str                   # as written (SQLAlchemy text)
    positional: str              # $1, $2, ... (asyncpg), a name used twice is one parameter
    names: tuple[str, ...]       # the parameter of each $n, in order
    clause: TextClause = field(compare=False)

    @classmethod
    def of(cls, sql: str) -> Statement:
        names: list[str] = []

        def number(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in names:
                names.append(name)
            return f"${names.index(name) + 1}"
        return cls(sql, _PARAMETER.sub(number, sql), tuple(names), text(sql))

    def arguments(self, values: Mapping[str, object]) -> list[object]:
        return [values[name] for name in self.names]


class Rows(Protocol):
    """Runs a Statement and returns its first row by column name (None: no row)."""

    async def row(self, statement: Statement, values: Mapping[str, object]) -> Mapping[str, Any] | None: ...

    async def rows(self, statement: Statement, values: Mapping[str, object]) -> list[Mapping[str, Any]]: ...


@dataclass(frozen=True, slots=True)
class _SessionRows:
    session: AsyncSession | AsyncConnection

    async def row(self, statement: Statement, values: Mapping[str, object]) -> Mapping[str, Any] | None:
        return cast(Mapping[str, Any] | None,
                    (await self.session.execute(statement.clause, dict(values))).mappings().first())

    async def rows(self, statement: Statement, values: Mapping[str, object]) -> list[Mapping[str, Any]]:
        found = (await self.session.execute(statement.clause, dict(values))).mappings().all()
        return cast(list[Mapping[str, Any]], list(found))


@dataclass(frozen=True, slots=True)
class _ConnectionRows:
    connection: asyncpg.Connection

    async def row(self, statement: Statement, values: Mapping[str, object]) -> Mapping[str, Any] | None:
        found: Mapping[str, Any] | None = await self.connection.fetchrow(statement.positional,
                                                                          *statement.arguments(values))
        return found

    async def rows(self, statement: Statement, values: Mapping[str, object]) -> list[Mapping[str, Any]]:
        return list(await self.connection.fetch(statement.positional, *statement.arguments(values)))


Executor: TypeAlias = AsyncSession | AsyncConnection | asyncpg.Connection | Rows
"""What the run path's statements run on: the caller's SQLAlchemy transaction or a hot connection."""


def rows_of(executor: Executor) -> Rows:
    """The statement runner of a SQLAlchemy session or connection, or of a raw asyncpg connection."""
    if isinstance(executor, asyncpg.Connection):
        return _ConnectionRows(executor)
    if isinstance(executor, (AsyncSession, AsyncConnection)):
        return _SessionRows(executor)
    return executor


# Type OIDs below this are PostgreSQL's own (pg_type.dat, FirstNormalObjectId): the same in every
# database of every server, so what one connection learnt about them holds for all.
_FIRST_NORMAL_OID = 16384


@dataclass(frozen=True, slots=True)
class _Cached:
    """Stands for the introspection statement when the types came from the cache: no statement ran,
    so the caller's anonymous statement was not replaced (a truthy name: nothing to prepare again)."""

    name: str = "sluice-cached-types"


class KnownTypesConnection(asyncpg.Connection):  # type: ignore[misc]
    """An asyncpg connection that introspects each of PostgreSQL's own types once per process.

    asyncpg looks up, on every new connection, the types a statement uses that it has no codec for
    (the arrays the batched statements bind: uuid[], bigint[], integer[], text[], float8[]): a
    recursive catalog query of ~7 ms of PostgreSQL CPU (and two to turn JIT off and on), paid again
    by each connection a pool opens (issue 9: ~0.3-0.6 ms a run while pools grew in a bench phase).
    Built-in types' rows are kept here for every later connection; other types (a database's own)
    are looked up as asyncpg does. Relies on asyncpg's Connection._introspect_types (0.32, pinned)."""

    _types: dict[int, Any] = {}       # type OID -> asyncpg's introspection row, built-in types only

    async def prepare(self, query: str, **options: Any) -> Any:
        """asyncpg prepares with Parse, Describe and Flush, not Sync: PostgreSQL's implicit transaction
        opened by the Parse stays open until the connection's next Sync. asyncpg's own type lookup
        sends one at once; when the types come from the cache here, nothing does, and a statement
        prepared now and run later would run in a transaction begun at the prepare: its now() frozen
        there (seen: a lease keeper idle after connecting renewed leases seconds into the past, and
        healthy runs were reaped). A one-row simple query ends that transaction (outside one of the
        caller's own)."""
        statement = await super().prepare(query, **options)
        if not self.is_in_transaction():
            await self.execute("SELECT 1")
        return statement

    async def _introspect_types(self, typeoids: Any, limit: Any) -> tuple[Any, Any]:
        known = KnownTypesConnection._types
        oids = list(typeoids)
        if all(oid in known for oid in oids):
            return [known[oid] for oid in oids], _Cached()
        rows, statement = await super()._introspect_types(typeoids, limit)
        for row in rows:
            if row["oid"] < _FIRST_NORMAL_OID:
                known[row["oid"]] = row
        return rows, statement


async def _keep_session_state(connection: asyncpg.Connection) -> None:
    """Pool reset hook: nothing to reset (see the module doc)."""


async def _decode_json(connection: asyncpg.Connection) -> None:
    """json/jsonb columns as Python values, as SQLAlchemy's asyncpg dialect returns them."""
    for name in ("json", "jsonb"):
        await connection.set_type_codec(name, encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


def asyncpg_dsn(dsn: str) -> str:
    """A SQLAlchemy database URL (postgresql+asyncpg://...) as asyncpg takes it, password included."""
    return make_url(dsn).set(drivername="postgresql").render_as_string(hide_password=False)


class HotPool:
    """A small asyncpg pool, opened on first use on the running event loop; close() it on that loop."""

    def __init__(self, dsn: str, size: int = POOL_SIZE) -> None:
        self.dsn = asyncpg_dsn(dsn)
        self.size = size
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()
        # Monotonic time a connection was last handed back without an error: PostgreSQL answered
        # then, so a health probe that finds this recent need not ask again (services/operability.py).
        self.answered_at = -math.inf

    async def _open(self) -> asyncpg.Pool:
        async with self._opening:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=self.size,
                                                       init=_decode_json, reset=_keep_session_state,
                                                       connection_class=KnownTypesConnection,
                                                       server_settings=HOT_SETTINGS)
            return self._pool

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        pool = self._pool or await self._open()
        async with pool.acquire() as connection:
            yield connection
        self.answered_at = time.monotonic()

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()
