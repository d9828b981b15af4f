"""Real-PostgreSQL fixtures: every test gets its own freshly migrated database.

`alembic upgrade head` runs once per pytest session into a template database; each test then gets
`CREATE DATABASE … TEMPLATE …` (a file copy, ~50 ms) and drops it afterwards, so tests never share
state and can run in any order. The server is the configured one ([database].dsn, overridable with
SLUICE_DATABASE__DSN); its role needs CREATEDB.

Use from a test module (or register it once in tests/conftest.py):

    pytest_plugins = ["tests.support.db"]
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from ledger.db import configured_dsn, make_engine, make_sessionmaker
from sluice_config import REPO_ROOT

ALEMBIC_INI = REPO_ROOT / "alembic.ini"


def with_database(dsn: str, database: str) -> str:
    """The same server and credentials, another database."""
    return make_url(dsn).set(database=database).render_as_string(hide_password=False)


def asyncpg_dsn(dsn: str) -> str:
    return make_url(dsn).set(drivername="postgresql").render_as_string(hide_password=False)


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
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
async def ledger_template() -> AsyncIterator[str]:
    """Name of a database migrated to head once per session; used only as a template."""
    name = unique_name("sluice_test_template")
    dsn = await create_database(name)
    try:
        await run_alembic(dsn, "upgrade", "head")
        yield name
    finally:
        await drop_database(name)


@pytest.fixture
async def database_dsn(ledger_template: str) -> AsyncIterator[str]:
    """DSN of a fresh, migrated, empty database owned by this test alone."""
    name = unique_name("sluice_test")
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
