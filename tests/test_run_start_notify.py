"""Which ledger writes NOTIFY a run's Streams (ledger/runs_sql.py), on the real PostgreSQL: RUNNING
always (with where the run's events start, or before they are durable without it); the start recorded
after such a RUNNING never (a Stream that needs it re-reads the ledger); terminal-published only for a
run that never went RUNNING (its start is recorded then)."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest
from sluice.ledger.channels import EVENTS_CHANNEL
from sluice.ledger.db import dsn_of
from sluice.ledger.pg import asyncpg_dsn
from sluice.ledger.runs_sql import (
    PublishedMark,
    RunningMark,
    mark_published,
    mark_published_many,
    mark_running,
    mark_running_many,
    record_starts,
)
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluice.eventlog.interface import LogPosition
from tests.support.ledger_factories import DEFAULT_MODEL, add_model, add_tenant, prompt_of

pytestmark = pytest.mark.integration

EPOCH = 1


async def queued_run(api, sessionmaker: async_sessionmaker[AsyncSession], name: str) -> str:  # type: ignore[no-untyped-def]
    async with sessionmaker() as session, session.begin():
        tenant = await add_tenant(session, name)
    run_id = (await api.submit(tenant, prompt_of(4), 4)).run_id
    async with sessionmaker() as session, session.begin():
        await session.execute(text("UPDATE runs SET status = 'QUEUED', lease_epoch = :epoch WHERE id = :id"),
                              {"epoch": EPOCH, "id": uuid.UUID(run_id)})
    return str(run_id)


async def heard_within(queue: asyncio.Queue[str], seconds: float) -> list[str]:
    await asyncio.sleep(seconds)
    heard = []
    while not queue.empty():
        heard.append(queue.get_nowait())
    return heard


async def test_published_notifies_only_a_run_that_never_went_running(api, sessionmaker):  # type: ignore[no-untyped-def]
    async with sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, DEFAULT_MODEL)
    ran = await queued_run(api, sessionmaker, "acme")
    never_ran = await queued_run(api, sessionmaker, "globex")
    dsn = asyncpg_dsn(dsn_of(sessionmaker))
    listener, writer = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    heard: asyncio.Queue[str] = asyncio.Queue()
    await listener.add_listener(EVENTS_CHANNEL, lambda _c, _p, _ch, payload: heard.put_nowait(payload))
    try:
        assert await mark_running(writer, ran, EPOCH, LogPosition(0, 10), 1, EVENTS_CHANNEL)
        assert await heard_within(heard, 0.3) == [ran]
        await mark_published(writer, ran, 3, LogPosition(0, 12), EVENTS_CHANNEL)
        await mark_published(writer, never_ran, 1, LogPosition(0, 20), EVENTS_CHANNEL)
        assert await heard_within(heard, 0.3) == [never_ran]
        row = await writer.fetchrow("SELECT event_partition, event_first_offset, terminal_published FROM runs"
                                    " WHERE id = $1", uuid.UUID(never_ran))
        assert tuple(row) == (0, 20, True)            # its start is its terminal event's position
    finally:
        await listener.close()
        await writer.close()


async def test_one_running_statement_marks_each_run_under_its_own_epoch_and_notifies_each(api, sessionmaker):  # type: ignore[no-untyped-def]
    async with sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, DEFAULT_MODEL)
    runs = [await queued_run(api, sessionmaker, name) for name in ("acme", "globex", "initech")]
    dsn = asyncpg_dsn(dsn_of(sessionmaker))
    listener, writer = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    heard: asyncio.Queue[str] = asyncio.Queue()
    await listener.add_listener(EVENTS_CHANNEL, lambda _c, _p, _ch, payload: heard.put_nowait(payload))
    marks = [RunningMark(runs[0], EPOCH, LogPosition(0, 10), 1),
             RunningMark(runs[1], EPOCH + 1, LogPosition(1, 20), 1),    # a lease this run never had
             RunningMark(runs[2], EPOCH, LogPosition(2, 30), 1)]
    try:
        assert await mark_running_many(writer, marks, EVENTS_CHANNEL) == [True, False, True]
        assert sorted(await heard_within(heard, 0.3)) == sorted([runs[0], runs[2]])
        rows = await writer.fetch("SELECT id::text, status, event_partition, event_first_offset FROM runs"
                                  " WHERE id = ANY($1::uuid[])", [uuid.UUID(run) for run in runs])
        assert {row["id"]: tuple(row)[1:] for row in rows} == {
            runs[0]: ("RUNNING", 0, 10), runs[1]: ("QUEUED", None, None), runs[2]: ("RUNNING", 2, 30)}
        # Published together: only the run that never went RUNNING is notified.
        await mark_published_many(writer, [PublishedMark(runs[0], 3, LogPosition(0, 12)),
                                           PublishedMark(runs[1], 1, LogPosition(1, 21))], EVENTS_CHANNEL)
        assert await heard_within(heard, 0.3) == [runs[1]]
        rows = await writer.fetch("SELECT id::text, terminal_published, event_first_offset, last_sequence"
                                  " FROM runs WHERE id = ANY($1::uuid[])", [uuid.UUID(run) for run in runs])
        assert {row["id"]: tuple(row)[1:] for row in rows} == {
            runs[0]: (True, 10, 3), runs[1]: (True, 21, 1), runs[2]: (False, 30, 1)}
    finally:
        await listener.close()
        await writer.close()


async def test_running_without_its_start_notifies_and_the_start_recorded_later_does_not(api, sessionmaker):  # type: ignore[no-untyped-def]
    async with sessionmaker() as session, session.begin():
        await add_model(session, api.tokenizer, DEFAULT_MODEL)
    runs = [await queued_run(api, sessionmaker, name) for name in ("acme", "globex")]
    dsn = asyncpg_dsn(dsn_of(sessionmaker))
    listener, writer = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    heard: asyncio.Queue[str] = asyncio.Queue()
    await listener.add_listener(EVENTS_CHANNEL, lambda _c, _p, _ch, payload: heard.put_nowait(payload))

    async def rows() -> dict[str, tuple[object, ...]]:
        found = await writer.fetch("SELECT id::text, status, started_at IS NOT NULL, event_partition,"
                                   " event_first_offset, last_sequence FROM runs WHERE id = ANY($1::uuid[])",
                                   [uuid.UUID(run) for run in runs])
        return {row["id"]: tuple(row)[1:] for row in found}

    try:
        marks = [RunningMark(run, EPOCH, None, 0) for run in runs]
        assert await mark_running_many(writer, marks, EVENTS_CHANNEL) == [True, True]
        assert sorted(await heard_within(heard, 0.3)) == sorted(runs)
        assert await rows() == {run: ("RUNNING", True, None, None, 0) for run in runs}
        starts = [RunningMark(runs[0], EPOCH, LogPosition(1, 40), 1),
                  RunningMark(runs[1], EPOCH + 1, LogPosition(1, 50), 1)]     # an epoch it does not hold
        assert await record_starts(writer, starts) == [True, False]
        assert await heard_within(heard, 0.3) == []
        assert await rows() == {runs[0]: ("RUNNING", True, 1, 40, 1),
                                runs[1]: ("RUNNING", True, None, None, 0)}
    finally:
        await listener.close()
        await writer.close()
