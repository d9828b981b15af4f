"""The test-database cleanup drops what killed sessions left behind, and nothing anyone still uses."""

from __future__ import annotations

import os
import subprocess
import uuid

import asyncpg
import pytest
from sluice.ledger.db import configured_dsn

from tests.support.db import (
    asyncpg_dsn,
    create_database,
    creator_pid,
    drop_database,
    drop_stale_test_databases,
    unique_name,
)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_names_carry_the_creating_process():
    name = unique_name("sluice_test_template")
    assert name.startswith(f"sluice_test_template_p{os.getpid()}_")
    assert creator_pid(name) == os.getpid()
    assert creator_pid(unique_name("sluice_test")) == os.getpid()
    assert creator_pid("sluice_test_template_3993a0b57d00") is None   # made before pids were named
    assert creator_pid("sluice_bench_p12_3993a0b57d00") is None        # not a test database


@pytest.mark.integration
async def test_only_unconnected_databases_of_dead_sessions_are_dropped():
    gone = dead_pid()
    stale = f"sluice_test_p{gone}_{uuid.uuid4().hex[:12]}"
    in_use = f"sluice_test_p{gone}_{uuid.uuid4().hex[:12]}"
    ours = unique_name("sluice_test")
    legacy = f"sluice_test_{uuid.uuid4().hex[:12]}"
    dsns = {name: await create_database(name) for name in (stale, in_use, ours, legacy)}
    holder = await asyncpg.connect(asyncpg_dsn(dsns[in_use]))
    try:
        dropped = await drop_stale_test_databases()

        assert stale in dropped
        assert not {in_use, ours, legacy} & set(dropped)
        assert await existing({stale, in_use, ours, legacy}) == {in_use, ours, legacy}
    finally:
        await holder.close()
        for name in (stale, in_use, ours, legacy):
            await drop_database(name)


async def existing(names: set[str]) -> set[str]:
    connection = await asyncpg.connect(asyncpg_dsn(configured_dsn()))
    try:
        rows = await connection.fetch("SELECT datname FROM pg_database WHERE datname = ANY($1::text[])",
                                      list(names))
        return {row[0] for row in rows}
    finally:
        await connection.close()
