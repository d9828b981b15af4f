"""The runs table's indexes on the real PostgreSQL (migration 0013): a RUNNING mark is a HOT update
(no index of runs keys on or filters by a column it changes), and every query that reads runs through
a partial index still names that index's predicate, so the planner can use it (a partial index serves
only a query whose conditions imply its predicate; without them the query scans runs whole), and a
hot connection's statement keeps reading by key when the table grew after its plan was made."""

from __future__ import annotations

import uuid

import pytest
from sluice.ledger import admission_sql, claims_sql, fallbacks, pool_load, runs_sql
from sluice.ledger.models import Model
from sluice.ledger.pg import HotPool, Statement
from sluice.ledger.runs_sql import RunningMark, mark_running_many
from sluice.services.routing import claims
from sqlalchemy import TextClause, text

from sluice.eventlog.interface import LogPosition
from tests.support.ledger_factories import DEFAULT_MODEL, add_model, add_tenant, prompt_of
from tests.support.ledger_services import Services

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]
pytestmark = pytest.mark.integration

# This transaction's own row counts for runs, before statistics are reported (no waiting for them).
_UPDATES = text("SELECT pg_stat_get_xact_tuples_updated('runs'::regclass) AS updated,"
                " pg_stat_get_xact_tuples_hot_updated('runs'::regclass) AS hot")


async def claimed_run(api: Services, hot_pool: HotPool) -> tuple[str, int]:
    """A run submitted and claimed as the routing worker claims it: (run id, lease epoch)."""
    async with api.sessionmaker() as session, session.begin():
        if await session.get(Model, DEFAULT_MODEL.version) is None:
            await add_model(session, api.tokenizer)
        tenant = await add_tenant(session, f"t{uuid.uuid4().hex[:6]}")
    await api.submit(tenant, prompt_of(4), 8)
    async with hot_pool.connection() as connection, connection.transaction():
        locked = await claims_sql.lock_accepted(connection, 8)
        routed = {row["id"]: "replica-0" for row in locked}
        queued = await claims_sql.queue_runs(connection, routed, "w:1", 30.0)
    [(run_id, (_, epoch))] = queued.items()
    return str(run_id), epoch


async def test_a_running_mark_is_a_hot_update(api: Services, hot_pool: HotPool):
    run_id, epoch = await claimed_run(api, hot_pool)
    async with api.sessionmaker() as session, session.begin():
        before = (await session.execute(_UPDATES)).one()
        running = await mark_running_many(session, [RunningMark(run_id, epoch, LogPosition(0, 7), 1)], "test")
        after = (await session.execute(_UPDATES)).one()
    assert running == [True]
    # One row updated, in place: had any index keyed on or filtered by status, started_at or the
    # event start, PostgreSQL would have written a new entry in every index instead.
    assert (after.updated - before.updated, after.hot - before.hot) == (1, 1)


def _reader(statement: Statement | TextClause) -> TextClause:
    return statement.clause if isinstance(statement, Statement) else statement


# (what reads, its statement, the values it is planned with, the index it must be able to use)
READERS: list[tuple[str, Statement | TextClause, dict[str, object], str]] = [
    ("the claim", claims_sql._LOCK_ACCEPTED, {"limit": 8, "excluding": []}, "_unclaimed"),
    ("the claim's poll", claims_sql._ANY_ACCEPTED, {}, "_unclaimed"),
    ("the claim's GPU-memory sums", claims_sql._HELD, {"tenants": [uuid.uuid4()]},
     "ix_runs_tenant_id_unfinished"),
    ("admission's backlog", admission_sql._READ, {
        "key_hash": "k", "key_prefix": "k", "name": DEFAULT_MODEL.version, "backlog_limit": 100,
        "split_point": 0, "batch_backlog_limit": 1}, "_unclaimed"),
    ("a fallback's backlog", fallbacks._CANDIDATES, {"names": [DEFAULT_MODEL.version], "backlog_limit": 100},
     "_unclaimed"),
    ("the reaper's expired leases", claims._TAKE_EXPIRED, {"owner": "r", "lease_seconds": 5.0, "limit": 8},
     "ix_runs_tenant_id_unfinished"),
    ("the reaper's unpublished terminals", claims._TAKE_UNPUBLISHED,
     {"owner": "r", "lease_seconds": 5.0, "limit": 8}, "ix_runs_id_unpublished"),
    ("each replica's runs", pool_load._BY_REPLICA, {"names": ["replica-0"]}, "ix_runs_tenant_id_unfinished"),
]


@pytest.mark.parametrize(("reader", "statement", "values", "index"), READERS, ids=[r[0] for r in READERS])
async def test_each_reader_of_a_partial_index_can_use_it(api: Services, reader: str, statement: Statement,
                                                         values: dict[str, object], index: str):
    async with api.sessionmaker() as session, session.begin():
        # A scan of runs whole is made to look ruinous: a plan that still shows one had no index it could use.
        await session.execute(text("SET LOCAL enable_seqscan = off"))
        await session.execute(text("SET LOCAL jit = off"))
        plan = "\n".join(row[0] for row in await session.execute(
            text("EXPLAIN (COSTS OFF) " + _reader(statement).text), values))
    assert "Seq Scan on runs" not in plan, f"{reader} scans runs whole:\n{plan}"
    assert index in plan, f"{reader} does not read runs through an index named *{index}*:\n{plan}"



async def test_a_hot_statement_planned_on_a_small_table_still_reads_by_key_once_it_grew(
        api: Services, hot_pool: HotPool):
    run_id, epoch = await claimed_run(api, hot_pool)
    statement = runs_sql._MARK_RUNNING_MANY
    values = {"run_ids": [uuid.UUID(run_id)], "epochs": [epoch], "partitions": [0], "first_offsets": [1],
              "last_sequences": [1], "channel": "test"}
    async with hot_pool.connection() as connection:
        await connection.execute("ANALYZE runs")    # the statistics of a ledger with one run
        prepared = await connection.prepare(statement.positional)
        for _ in range(6):          # generic plans from the first (else after five custom ones)
            await prepared.fetch(*statement.arguments(values))
        # The ledger grows, no ANALYZE yet: the generic plan made for one run is what runs next.
        await connection.execute("""
            INSERT INTO runs (tenant_id, request_key, payload_hash, model_version, prompt_token_ids,
                              input_tokens, max_output_tokens, deadline_at, reserved_tokens,
                              reserved_cost_micros)
            SELECT tenant_id, request_key || g, payload_hash, model_version, prompt_token_ids, input_tokens,
                   max_output_tokens, deadline_at, reserved_tokens, reserved_cost_micros
              FROM runs, generate_series(1, 3000) g""")
        plan = "\n".join(row[0] for row in await connection.fetch(
            f"EXPLAIN (COSTS OFF) EXECUTE {prepared.get_name()}"
            f"({', '.join(['NULL'] * len(statement.names))})"))
    assert "Seq Scan on runs" not in plan, plan


async def test_a_hot_write_is_never_planned_again_per_execution(api: Services, hot_pool: HotPool):
    run_id, epoch = await claimed_run(api, hot_pool)
    marks = [RunningMark(run_id, epoch, LogPosition(0, 7), 1)]
    async with hot_pool.connection() as connection:
        for _ in range(8):
            assert await mark_running_many(connection, marks, "test") == [True]
        row = await connection.fetchrow(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1",
            runs_sql._MARK_RUNNING_MANY.positional)
    # A custom plan is a plan made for one execution's values (~140 us of planning each time).
    assert (row["generic_plans"], row["custom_plans"]) == (8, 0)
