"""Real-PostgreSQL fixtures: every test gets its own freshly migrated database.

`alembic upgrade head` runs once per pytest session into a template database; each test then gets
`CREATE DATABASE … TEMPLATE …` (a file copy, ~50 ms) and drops it afterwards, so tests never share
state and can run in any order. The server is the configured one ([database].dsn, overridable with
SLUICE_DATABASE__DSN); its role needs CREATEDB.

Every database this module names carries the creating process's pid (`sluice_test_…_p<pid>_<hex>`).
A session killed before its teardown leaves its databases behind; the next session drops those
at start, but only where the pid in the name is no longer a live process and nobody is connected,
so concurrent pytest sessions (other engineers, CI) never lose a database they are using.

Use from a test module (or register it once in tests/conftest.py):

    pytest_plugins = ["tests.support.db"]
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from alembic import command
from alembic.config import Config
from sluice.ledger.db import configured_dsn, make_engine, make_sessionmaker
from sluice.ledger.pg import HotPool
from sluice.ledger.pg import asyncpg_dsn as asyncpg_dsn  # re-exported: tests import it from here
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from tests.support import REPO_ROOT

ALEMBIC_INI = REPO_ROOT / "alembic.ini"

TEST_DATABASE_PREFIX = "sluice_test"
# What unique_name() makes of a sluice_test… prefix: the creator's pid, then 12 hex digits.
_CREATED_BY = re.compile(rf"^{TEST_DATABASE_PREFIX}(?:_[a-z]+)*_p(?P<pid>\d+)_[0-9a-f]{{12}}$")

log = logging.getLogger(__name__)


def with_database(dsn: str, database: str) -> str:
    """The same server and credentials, another database."""
    return make_url(dsn).set(database=database).render_as_string(hide_password=False)


def alembic_config(dsn: str) -> Config:
    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(Path(REPO_ROOT) / "migrations"))
    # ConfigParser interpolation would eat a literal '%' in the password.
    config.set_main_option("sqlalchemy.url", dsn.replace("%", "%%"))
    return config


async def run_alembic(dsn: str, *args: str) -> None:
    """`alembic upgrade head` etc. on `dsn`, in a worker thread (env.py runs its own event loop)."""
    verb, *rest = args
    config = alembic_config(dsn)
    await asyncio.to_thread(getattr(command, verb), config, *rest)


async def admin_execute(statement: str) -> None:
    """Run one statement outside a transaction (CREATE/DROP DATABASE need that)."""
    connection = await asyncpg.connect(asyncpg_dsn(configured_dsn()))
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


async def create_database(name: str, template: str | None = None) -> str:
    suffix = f' TEMPLATE "{template}"' if template else ""
    await admin_execute(f'CREATE DATABASE "{name}"{suffix}')
    return with_database(configured_dsn(), name)


async def drop_database(name: str) -> None:
    await admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def unique_name(prefix: str) -> str:
    """`<prefix>_p<pid>_<12 hex>`: unique, and names the process that may still be using it."""
    return f"{prefix}_p{os.getpid()}_{uuid.uuid4().hex[:12]}"


def creator_pid(name: str) -> int | None:
    match = _CREATED_BY.match(name)
    return int(match["pid"]) if match else None


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


async def drop_stale_test_databases() -> list[str]:
    """Drop test databases left by killed sessions; returns the names dropped.

    Stale means all of: a name unique_name() made, whose creator pid is not a live process (so not
    this session, nor any other running one), and no connection to it. Names without a pid (made
    before this scheme) are left alone: nothing tells whether their session still runs. DROP
    without FORCE, so a connection that arrives in between makes it fail, and it is skipped.
    """
    connection = await asyncpg.connect(asyncpg_dsn(configured_dsn()))
    try:
        rows = await connection.fetch(
            "SELECT d.datname FROM pg_database d WHERE d.datname LIKE $1"
            " AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.datname = d.datname)",
            TEST_DATABASE_PREFIX.replace("_", "\\_") + "\\_%",
        )
        dropped = []
        for (name,) in rows:
            pid = creator_pid(name)
            if pid is None or pid == os.getpid() or process_alive(pid):
                continue
            try:
                await connection.execute(f'DROP DATABASE IF EXISTS "{name}"')
            except asyncpg.ObjectInUseError:
                continue
            dropped.append(name)
        if dropped:
            log.info("dropped %d stale test databases: %s", len(dropped), ", ".join(dropped))
        return dropped
    finally:
        await connection.close()


@pytest.fixture(scope="session")
async def ledger_template() -> AsyncIterator[str]:
    """Name of a database migrated to head once per session; used only as a template."""
    await drop_stale_test_databases()
    name = unique_name(f"{TEST_DATABASE_PREFIX}_template")
    dsn = await create_database(name)
    try:
        await run_alembic(dsn, "upgrade", "head")
        yield name
    finally:
        await drop_database(name)


@pytest.fixture
async def database_dsn(ledger_template: str) -> AsyncIterator[str]:
    """DSN of a fresh, migrated, empty database owned by this test alone."""
    name = unique_name(TEST_DATABASE_PREFIX)
    dsn = await create_database(name, template=ledger_template)
    try:
        yield dsn
    finally:
        await drop_database(name)


@pytest.fixture
async def engine(database_dsn: str) -> AsyncIterator[AsyncEngine]:
    engine = make_engine(database_dsn, pool_size=20, max_overflow=40)
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
def sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return make_sessionmaker(engine)


@pytest.fixture
async def hot_pool(database_dsn: str) -> AsyncIterator[HotPool]:
    """The test database's raw asyncpg pool, as the routing worker's run path uses (ledger/pg.py)."""
    pool = HotPool(database_dsn)
    try:
        yield pool
    finally:
        await pool.close()
