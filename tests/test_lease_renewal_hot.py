"""A lease renewal is a HOT update (migration 0012): PostgreSQL rewrites each renewed run on its page
without a new entry in any of runs' indexes, so renewing every lease a worker holds each interval
costs no index maintenance. HOT needs two things, both checked here on the real server: no column the
renewal sets is indexed (an index key, expression or predicate column), and the page has room."""

from __future__ import annotations

import re
import uuid

import asyncpg
from sluice.ledger.pg import asyncpg_dsn
from sluice.services.routing.leases import RENEW_SQL

from tests.support.ledger_services import Services
from tests.test_routing_leases import LEASE_S, dsn_of, queued_run

pytest_plugins = ["tests.support.db", "tests.support.ledger_services"]

RUNS = 5

# Every column of runs that any of its indexes uses: keys, expressions and partial-index predicates.
INDEXED_COLUMNS = """
SELECT DISTINCT a.attname
  FROM pg_index i
  JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum > 0
 WHERE i.indrelid = 'runs'::regclass
   AND (a.attnum = ANY (i.indkey)
        OR pg_get_expr(i.indpred, i.indrelid) ~ ('\\m' || a.attname || '\\M')
        OR pg_get_expr(i.indexprs, i.indrelid) ~ ('\\m' || a.attname || '\\M'))
"""


def renewed_columns() -> set[str]:
    """The columns the keeper's statement SETs (read from the statement itself)."""
    assignments = re.search(r"UPDATE runs AS r\s+SET (.*?)\s+FROM", RENEW_SQL, re.S)
    assert assignments is not None
    return set(re.findall(r"(\w+) = ", assignments.group(1)))


async def test_no_column_a_renewal_sets_is_indexed_and_runs_pages_keep_room(api: Services):
    connection = await asyncpg.connect(asyncpg_dsn(dsn_of(api)))
    try:
        indexed = {row["attname"] for row in await connection.fetch(INDEXED_COLUMNS)}
        options = await connection.fetchval("SELECT reloptions FROM pg_class WHERE oid = 'runs'::regclass")
    finally:
        await connection.close()
    assert renewed_columns() == {"lease_expires_at", "last_sequence", "output_tokens"}
    assert {"finished_at", "terminal_published", "id"} <= indexed    # it sees predicates (only) and keys
    assert renewed_columns() & indexed == set()
    fillfactor = int(dict(option.split("=") for option in options or [])["fillfactor"])
    assert fillfactor < 100


async def test_renewing_every_held_lease_updates_each_run_in_place(api: Services):
    held = [await queued_run(api) for _ in range(RUNS)]
    connection = await asyncpg.connect(asyncpg_dsn(dsn_of(api)))
    try:
        async with connection.transaction():
            rows = await connection.fetch(RENEW_SQL, LEASE_S, [uuid.UUID(run_id) for run_id, _ in held],
                                          [epoch for _, epoch in held], [3] * RUNS, [2] * RUNS)
            # This transaction's own counters: exact, no statistics collector involved.
            updated, hot = await connection.fetchrow(
                "SELECT pg_stat_get_xact_tuples_updated('runs'::regclass),"
                " pg_stat_get_xact_tuples_hot_updated('runs'::regclass)")
    finally:
        await connection.close()
    assert sorted(row["id"] for row in rows if row["remaining_s"] is not None) == \
        sorted(run_id for run_id, _ in held)
    assert (updated, hot) == (RUNS, RUNS)
