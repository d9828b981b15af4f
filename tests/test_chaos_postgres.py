"""The fault suite's PostgreSQL fault: a fast restart under load, on a throwaway server of its own
(port and data dir; never the shared PostgreSQL on :54329). Part of `make chaos` (SLUICE_CHAOS=1).

`database_dsn` is overridden in this module so the `stack` fixture runs on that server.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest
from sluice.ledger.models import RunStatus
from sluice_client.sdk import SluiceClient

from tests.support.chaos import ChaosResult, Load, conclude, expect_no_healthy_run_interrupted, full_only
from tests.support.db import run_alembic
from tests.support.replica_proc import free_ports
from tests.support.routing_stack import Stack
from tests.test_chaos_infra import PROMPT, infra, throwaway_dir

pytestmark = [pytest.mark.integration, full_only]

RESTARTS = 3


@pytest.fixture(scope="module")
def throwaway_postgres() -> Iterator[dict[str, str]]:
    (port,) = free_ports(1)
    env = {"SLUICE_PATHS__DATA_DIR": throwaway_dir("chaos-pg"),
           "SLUICE_DATABASE__PORT": str(port)}
    infra("postgres.sh", "start", env)
    try:
        infra("postgres.sh", "wait", env)
        yield {**env, "dsn": f"postgresql+asyncpg://sluice:sluice@127.0.0.1:{port}/sluice"}
    finally:
        infra("postgres.sh", "stop", env)
        shutil.rmtree(env["SLUICE_PATHS__DATA_DIR"], ignore_errors=True)


@pytest.fixture
async def database_dsn(throwaway_postgres: dict[str, str]) -> AsyncIterator[str]:
    name = f"chaos_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(throwaway_postgres["dsn"].replace("+asyncpg", ""))
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = throwaway_postgres["dsn"].rsplit("/", 1)[0] + f"/{name}"
    await run_alembic(dsn, "upgrade", "head")
    yield dsn


async def test_postgresql_restarts_under_load_lose_and_interrupt_nothing(
        throwaway_postgres: dict[str, str], stack: Stack):
    await stack.start_worker()
    started = time.monotonic()
    load = Load(stack)
    took: list[float] = []
    async with SluiceClient(stack.address, stack.tenant.api_key) as sdk:
        await load.submit(sdk, 20, 150, PROMPT)
        for _ in range(RESTARTS):
            await asyncio.sleep(1.0)
            at = time.monotonic()
            await asyncio.to_thread(infra, "postgres.sh", "restart", throwaway_postgres)
            took.append(time.monotonic() - at)
        result = await conclude(ChaosResult(f"PostgreSQL {RESTARTS} restarts under load"), load, started,
                                stream_timeout_s=120, terminal_timeout_s=60)
    result.note = (f"restarts took {', '.join(f'{s:.1f}' for s in took)} s (incl. the script);"
                   f" INTERRUPTED {result.statuses[RunStatus.INTERRUPTED]} of {result.runs}")
    assert result.passed, "\n".join(result.violations[:10])
    expect_no_healthy_run_interrupted(result)
    assert result.statuses == {RunStatus.COMPLETED: 20}, result.note
