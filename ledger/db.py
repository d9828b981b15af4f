"""Engine and session factories. One engine per process and event loop; never share across loops."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from sluice.config import load_settings


def configured_dsn() -> str:
    """The configured DSN (sluice.toml, SLUICE_CONFIG, SLUICE_DATABASE__DSN and __PASSWORD)."""
    return load_settings().database.url


def make_engine(dsn: str | None = None, *, pool_size: int = 10, max_overflow: int = 10) -> AsyncEngine:
    """An asyncpg-backed engine; `dsn` defaults to the configured one.

    No pre-ping: it would cost a round trip on every checkout, i.e. on every Submit. After a
    database restart the first statement on a stale pooled connection fails (the caller gets
    UNAVAILABLE, and every write is safe to retry) and SQLAlchemy then discards the whole pool
    (its disconnect handling), so the statements after it reconnect.
    """
    return create_async_engine(
        dsn or configured_dsn(),
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_pre_ping=False,
    )


def autocommit_engine(sessionmaker: async_sessionmaker[AsyncSession]) -> AsyncEngine:
    """The sessionmaker's engine (same pool) running each statement as its own transaction: a
    single-statement read or write then costs one round trip, with no BEGIN and COMMIT around it."""
    engine = sessionmaker.kw.get("bind")
    assert isinstance(engine, AsyncEngine), "expected a sessionmaker bound to an AsyncEngine"
    return engine.execution_options(isolation_level="AUTOCOMMIT")


def dsn_of(sessionmaker: async_sessionmaker[AsyncSession]) -> str:
    """The database URL a session factory is bound to, password included (for a raw asyncpg pool)."""
    engine = sessionmaker.kw.get("bind")
    assert isinstance(engine, AsyncEngine), "expected a sessionmaker bound to an AsyncEngine"
    return engine.url.render_as_string(hide_password=False)


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    # expire_on_commit=False: objects read in a transaction stay usable after it commits, so a
    # service can commit first and build its response afterwards without lazy-loading I/O.
    return async_sessionmaker(engine, expire_on_commit=False)
