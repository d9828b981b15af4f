"""Alembic environment: migrations run on the async engine through `run_sync`.

Which database, first match wins:
  1. `-x dsn=...` on the alembic command line;
  2. `sqlalchemy.url` set on the Config by a caller (tests: `cfg.set_main_option(...)`);
  3. the configured DSN (sluice.config.load_settings(): sluice.toml, SLUICE_CONFIG, SLUICE_DATABASE__*).
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

from alembic import context
from sluice.ledger.models import Base
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from sluice.config import load_settings

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)
target_metadata = Base.metadata


def database_dsn() -> str:
    cli = context.get_x_argument(as_dictionary=True).get("dsn")
    if cli:
        return cli
    configured = config.get_main_option("sqlalchemy.url")
    if configured:
        return configured
    return load_settings().database.url


def run_migrations_offline() -> None:
    """Emit SQL to stdout (`alembic upgrade head --sql`) without connecting."""
    context.configure(
        url=database_dsn(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def do_run_migrations(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


async def run_async_migrations() -> None:
    # NullPool: a migration is one short-lived connection; nothing to keep warm.
    engine = create_async_engine(database_dsn(), poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(do_run_migrations)
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    asyncio.run(run_async_migrations())


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
