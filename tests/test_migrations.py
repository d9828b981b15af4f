"""Migrations on a real, empty database: upgrade head, downgrade base, upgrade again; and the
migrated schema matches ledger/models.py exactly (no drift for autogenerate to find)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sluice.ledger.db import make_engine, make_sessionmaker
from sluice.ledger.models import Base, Model
from sluice.ledger.repositories import TenantRepository
from sluice.ledger.seed import DEMO_API_KEY, OTHER_API_KEY, seed
from sqlalchemy import inspect, text

from tests.support.db import create_database, drop_database, run_alembic, unique_name

pytestmark = pytest.mark.integration

LEDGER_TABLES = {"tenants", "api_keys", "models", "runs", "budgets", "usage_entries", "price_cards",
                 "tenant_fallbacks", "canaries",
                 "admin_audit", "replicas"}


@pytest.fixture
async def empty_database() -> AsyncIterator[str]:
    name = unique_name("sluice_test_migrations")
    dsn = await create_database(name)
    try:
        yield dsn
    finally:
        await drop_database(name)


async def table_names(dsn: str) -> set[str]:
    engine = make_engine(dsn, pool_size=1, max_overflow=0)
    try:
        async with engine.connect() as connection:
            return set(await connection.run_sync(lambda sync: inspect(sync).get_table_names()))
    finally:
        await engine.dispose()


async def schema_drift(dsn: str) -> list[object]:
    engine = make_engine(dsn, pool_size=1, max_overflow=0)
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(
                lambda sync: compare_metadata(MigrationContext.configure(sync, opts={"compare_type": True}),
                                              Base.metadata)
            )
    finally:
        await engine.dispose()


async def test_upgrade_downgrade_and_upgrade_again_on_an_empty_database(empty_database):
    assert await table_names(empty_database) == set()

    await run_alembic(empty_database, "upgrade", "head")
    assert await table_names(empty_database) == LEDGER_TABLES | {"alembic_version"}

    await run_alembic(empty_database, "downgrade", "base")
    assert await table_names(empty_database) == {"alembic_version"}

    await run_alembic(empty_database, "upgrade", "head")
    assert await table_names(empty_database) == LEDGER_TABLES | {"alembic_version"}


async def test_the_migrated_schema_matches_the_models(empty_database):
    await run_alembic(empty_database, "upgrade", "head")

    assert await schema_drift(empty_database) == []


async def test_the_budget_check_constraints_refuse_an_overshoot_even_without_admission(empty_database):
    await run_alembic(empty_database, "upgrade", "head")
    engine = make_engine(empty_database, pool_size=1, max_overflow=0)
    try:
        async with engine.begin() as connection:
            await connection.execute(text("INSERT INTO tenants (name) VALUES ('t')"))
            await connection.execute(text(
                "INSERT INTO budgets (tenant_id, period_start, token_budget, cost_budget_micros)"
                " SELECT id, date '2026-01-01', 100, 100 FROM tenants"
            ))
        with pytest.raises(Exception, match="ck_budgets_tokens_within_budget"):
            async with engine.begin() as connection:
                await connection.execute(text("UPDATE budgets SET reserved_tokens = 60, used_tokens = 41"))
    finally:
        await engine.dispose()


async def test_the_seed_is_idempotent_and_its_demo_key_authenticates(empty_database):
    await run_alembic(empty_database, "upgrade", "head")

    await seed(empty_database, DEMO_API_KEY, OTHER_API_KEY)
    await seed(empty_database, DEMO_API_KEY, OTHER_API_KEY)

    engine = make_engine(empty_database, pool_size=1, max_overflow=0)
    try:
        async with make_sessionmaker(engine)() as session:
            counts = {
                table: await session.scalar(text(f"SELECT count(*) FROM {table}"))
                for table in ("models", "price_cards", "tenants", "api_keys", "budgets", "runs")
            }
            model = await session.get(Model, "tiny-chat-v1")
            small = await session.get(Model, "smollm2-135m-instruct")
            demo = await TenantRepository(session).by_api_key(DEMO_API_KEY)
    finally:
        await engine.dispose()
    # Seeding twice keeps one price card per model: the prices did not change.
    assert counts == {"models": 2, "price_cards": 2, "tenants": 2, "api_keys": 3, "budgets": 2, "runs": 0}
    assert model is not None
    assert (model.alias, model.end_id, model.context_limit) == ("chat", 0, 4096)  # end_id: <|endoftext|>
    assert small is not None   # end_id: SmolLM2's end of turn <|im_end|>, id 2 in its GGUF vocabulary
    assert (small.alias, small.end_id, small.context_limit, small.worker_pool) == (
        "chat-small", 2, 8192, "smollm2-135m-instruct")
    assert demo is not None and demo.name == "demo"
