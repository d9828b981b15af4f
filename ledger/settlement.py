"""Settle a run exactly once, inside the caller's transaction.

    settled = await settle_run(session, run_id, RunStatus.COMPLETED, output_tokens=40,
                               cached_input_tokens=0, detail=None)
    await session.commit()

The guard is `usage_entries.run_id UNIQUE`: the usage entry is inserted first with
ON CONFLICT (run_id) DO NOTHING, and only the statement whose insert took effect goes on to
finish the run and move its reservation to `used_*` (one statement with the insert: a settler is
one locked read and one write, and a lease holder settling under its epoch, the routing driver's
hot path, is one statement in all, issue 9). A concurrent second settler blocks on the unique index
until the first commits, then inserts nothing and returns False, touching nothing. If the caller's
transaction rolls back, the whole settlement (entry, status, budget) goes with it; outside a
transaction (a hot connection in autocommit) the lease holder's one statement is its own.

What is charged: the prompt when the run reached a replica (its `replica` is set; a run cancelled
while still ACCEPTED consumed nothing), cached prompt tokens at the cached rate, and the output
tokens reported. Counts are bounded by the reservation, so `used` never exceeds what was held.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.ledger.models import TERMINAL_STATUSES, Run, RunStatus, UsageEntry
from sluice.ledger.pg import Executor, Rows, Statement, rows_of
from sluice.ledger.pricing import TOKENS_PER_PRICE_UNIT, cost_micros
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession


class SettlementError(ValueError):
    """settle_run was called with values no run could have produced (a caller bug)."""


@dataclass(frozen=True, slots=True)
class SettledUsage:
    run_id: uuid.UUID
    status: RunStatus
    input_tokens: int                # prompt tokens charged (0 if the run never reached a replica)
    cached_input_tokens: int         # of which served from the prefix cache
    output_tokens: int
    cost_micros: int
    settled_at: dt.datetime


async def settle_run(
    session: AsyncSession,
    run_id: uuid.UUID | str,
    status: RunStatus | str,
    output_tokens: int,
    cached_input_tokens: int,
    detail: str | None,
    *,
    input_tokens: int | None = None,
) -> bool:
    """Finish the run in `status` and settle its usage; False (and no change) if already settled.

    `input_tokens` overrides the charged prompt size; by default it is the whole prompt when the
    run was handed to a replica and 0 when it never was.
    """
    settled = await settle_run_usage(session, run_id, status, output_tokens, cached_input_tokens, detail,
                                     input_tokens=input_tokens)
    return settled is not None


@dataclass(frozen=True, slots=True)
class TerminalFix:
    """What whoever settles a run fixes on it in the same statement (services/finish.py): the terminal
    event's sequence and a short lease for whoever publishes it next."""

    sequence: int                    # the TERMINAL event's
    last_sequence: int               # the last event before it
    lease_owner: str
    lease_seconds: float
    first_partition: int | None = None   # where the run's events start, when the ledger may lack it
    first_offset: int | None = None


class NotOwned(Exception):
    """settle_run_usage(owned_by_epoch=...) found the run no longer active under that lease epoch."""


_RUN_STATUSES_OWNED = "('QUEUED', 'RUNNING')"   # the statuses a lease holds (routing/claims.ACTIVE_CLAIMED)

# One read, row-locked: the run's counts and reservation, and the rates it settles at (its pinned
# price card, else its model's). A FOR UPDATE the settler's Runs.Cancel or lease may already hold.
_READ_RUN = """
SELECT r.id, r.tenant_id, r.model_version, r.replica, r.input_tokens, r.max_output_tokens,
       r.reserved_tokens, r.reserved_cost_micros, r.api_key_id, r.price_card_id,
       r.route_reason, r.worker_pool, r.quality_tier,
       COALESCE(c.price_input_per_m_micros, m.price_input_per_m_micros) AS price_input_per_m_micros,
       COALESCE(c.price_cached_input_per_m_micros, m.price_cached_input_per_m_micros)
           AS price_cached_input_per_m_micros,
       COALESCE(c.price_output_per_m_micros, m.price_output_per_m_micros) AS price_output_per_m_micros
FROM runs r
JOIN models m ON m.version = r.model_version
LEFT JOIN price_cards c ON c.id = r.price_card_id
WHERE r.id = :run_id
FOR UPDATE OF r
"""
_READ_ANY = Statement.of(_READ_RUN)

# Shared by both settlement statements: the entry's columns, its exactly-once guard, and the run
# finished (with the terminal fix when formatted with one) once the entry was inserted.
_INSERT_ENTRY = """INSERT INTO usage_entries (id, run_id, tenant_id, model_version, day, input_tokens,
                               cached_input_tokens, output_tokens, cost_micros, api_key_id, price_card_id,
                               route_reason, worker_pool, quality_tier)"""
_ENTRY_THEN_FINISHED = """    ON CONFLICT (run_id) DO NOTHING
    RETURNING settled_at
), finished AS (
    UPDATE runs
       SET status = :status, finished_at = now(), output_tokens = :output_tokens,
           cached_input_tokens = :cached_input_tokens, detail = CAST(:detail AS text){terminal}
     WHERE id = :run_id AND EXISTS (SELECT 1 FROM entry)
    RETURNING id
)"""

# The settlement in one statement. The usage entry goes first (ON CONFLICT (run_id) DO NOTHING: the
# exactly-once guard); the run and the budget change only when it was inserted. The budget row is the
# period the run was admitted in (its created_at), as admission chose it.
_WRITE = """
WITH entry AS (
""" + _INSERT_ENTRY + """
    VALUES (:entry_id, :run_id, :tenant_id, :model_version, date(timezone('UTC', now())), :input_tokens,
            :cached_input_tokens, :output_tokens, :cost_micros, :api_key_id, :price_card_id, :route_reason,
            :worker_pool, :quality_tier)
""" + _ENTRY_THEN_FINISHED + """, budget AS (
    UPDATE budgets b
       SET reserved_tokens = b.reserved_tokens - r.reserved_tokens,
           reserved_cost_micros = b.reserved_cost_micros - r.reserved_cost_micros,
           used_tokens = b.used_tokens + :used_tokens,
           used_cost_micros = b.used_cost_micros + :cost_micros
      FROM runs r
     WHERE r.id = :run_id AND b.tenant_id = r.tenant_id
       AND b.period_start = CAST(date_trunc('month', timezone('UTC', r.created_at)) AS date)
       AND EXISTS (SELECT 1 FROM entry)
    RETURNING 1
)
SELECT (SELECT settled_at FROM entry) AS settled_at, (SELECT count(*) FROM finished) AS runs,
       (SELECT count(*) FROM budget) AS budgets
"""
_TERMINAL_SET = """,
           terminal_sequence = :terminal_sequence, last_sequence = :last_sequence,
           lease_owner = :lease_owner, lease_expires_at = now() + make_interval(secs => :lease_seconds),
           event_partition = COALESCE(event_partition, :first_partition),
           event_first_offset = COALESCE(event_first_offset, :first_offset)"""
_SETTLE = Statement.of(_WRITE.format(terminal=""))
_SETTLE_TERMINAL = Statement.of(_WRITE.format(terminal=_TERMINAL_SET))


# The settlement of a run its lease holder ends (owned_by_epoch), in ONE statement and so one round
# trip and one commit: the run read row-locked under the epoch, the charge and its cost computed in
# SQL (as pricing.cost_micros_sql: every term non-negative, so + unit - 1 before the integer division
# rounds up as cost_micros does), then the entry, the run and the budget written as _WRITE does, all
# only when the counts are possible (else nothing is written, and the caller raises SettlementError).
_OWNED = """
WITH run AS (
    SELECT r.id, r.tenant_id, r.model_version, r.input_tokens, r.max_output_tokens, r.reserved_tokens,
           r.reserved_cost_micros, r.api_key_id, r.price_card_id, r.route_reason, r.worker_pool,
           r.quality_tier, r.created_at,
           COALESCE(CAST(:input_tokens AS integer),
                    CASE WHEN r.replica IS NULL THEN 0 ELSE r.input_tokens END) AS charged_input,
           COALESCE(c.price_input_per_m_micros, m.price_input_per_m_micros) AS price_input,
           COALESCE(c.price_cached_input_per_m_micros, m.price_cached_input_per_m_micros) AS price_cached,
           COALESCE(c.price_output_per_m_micros, m.price_output_per_m_micros) AS price_output
      FROM runs r
      JOIN models m ON m.version = r.model_version
      LEFT JOIN price_cards c ON c.id = r.price_card_id
     WHERE r.id = :run_id AND r.lease_epoch = :epoch AND r.status IN {owned}
       FOR UPDATE OF r
), charge AS (
    SELECT run.*,
           (0 <= charged_input AND charged_input <= input_tokens
            AND 0 <= :cached_input_tokens AND :cached_input_tokens <= charged_input
            AND 0 <= :output_tokens AND :output_tokens <= max_output_tokens) AS possible,
           (CAST(charged_input - :cached_input_tokens AS bigint) * price_input
            + CAST(:cached_input_tokens AS bigint) * price_cached
            + CAST(:output_tokens AS bigint) * price_output + {unit_less_one}) / {unit} AS cost_micros
      FROM run
), entry AS (
""" + _INSERT_ENTRY + """
    SELECT CAST(:entry_id AS uuid), id, tenant_id, model_version, date(timezone('UTC', now())),
           charged_input,
           :cached_input_tokens, :output_tokens, cost_micros, api_key_id, price_card_id, route_reason,
           worker_pool, quality_tier
      FROM charge WHERE possible
""" + _ENTRY_THEN_FINISHED + """, budget AS (
    UPDATE budgets b
       SET reserved_tokens = b.reserved_tokens - charge.reserved_tokens,
           reserved_cost_micros = b.reserved_cost_micros - charge.reserved_cost_micros,
           used_tokens = b.used_tokens + charge.charged_input + :output_tokens,
           used_cost_micros = b.used_cost_micros + charge.cost_micros
      FROM charge
     WHERE b.tenant_id = charge.tenant_id
       AND b.period_start = CAST(date_trunc('month', timezone('UTC', charge.created_at)) AS date)
       AND EXISTS (SELECT 1 FROM entry)
    RETURNING 1
)
SELECT charge.id IS NOT NULL AS owned, charge.possible, charge.tenant_id, charge.input_tokens,
       charge.max_output_tokens, charge.charged_input, charge.cost_micros,
       (SELECT settled_at FROM entry) AS settled_at, (SELECT count(*) FROM finished) AS runs,
       (SELECT count(*) FROM budget) AS budgets
  FROM (SELECT 1) AS one LEFT JOIN charge ON true
"""
_OWNED_FORMAT = {"owned": _RUN_STATUSES_OWNED, "unit": TOKENS_PER_PRICE_UNIT,
                 "unit_less_one": TOKENS_PER_PRICE_UNIT - 1}
_SETTLE_OWNED = Statement.of(_OWNED.format(terminal="", **_OWNED_FORMAT))
_SETTLE_OWNED_TERMINAL = Statement.of(_OWNED.format(terminal=_TERMINAL_SET, **_OWNED_FORMAT))


async def _settle_owned(rows: Rows, run_id: uuid.UUID, status: RunStatus, output_tokens: int,
                        cached_input_tokens: int, detail: str | None, input_tokens: int | None, epoch: int,
                        terminal: TerminalFix | None) -> SettledUsage | None:
    """settle_run_usage(owned_by_epoch=epoch) in one statement (_OWNED)."""
    values: dict[str, object] = {
        "entry_id": uuid.uuid4(), "run_id": run_id, "epoch": epoch, "input_tokens": input_tokens,
        "cached_input_tokens": cached_input_tokens, "output_tokens": output_tokens, "status": status.value,
        "detail": detail}
    written = await _write(rows, (_SETTLE_OWNED, _SETTLE_OWNED_TERMINAL), values, terminal)
    if not written["owned"]:
        raise NotOwned(f"run {run_id} is not active under lease epoch {epoch}")
    if not written["possible"]:
        _check_counts(run_id, written["input_tokens"], written["max_output_tokens"], written["charged_input"],
                      cached_input_tokens, output_tokens)
        raise AssertionError(f"run {run_id}: the ledger refused counts that _check_counts accepts")
    if written["settled_at"] is None:
        return None
    assert written["budgets"] == 1, (
        f"no budget row for tenant {written['tenant_id']} in the period run {run_id} was admitted in:"
        " a reservation was lost")
    return SettledUsage(run_id=run_id, status=status, input_tokens=written["charged_input"],
                        cached_input_tokens=cached_input_tokens, output_tokens=output_tokens,
                        cost_micros=int(written["cost_micros"]), settled_at=written["settled_at"])


async def _write(rows: Rows, statements: tuple[Statement, Statement], values: dict[str, object],
                 terminal: TerminalFix | None) -> Mapping[str, Any]:
    """Run the settlement statement (statements: without, with the terminal fix); its one row."""
    plain, with_terminal = statements
    if terminal is not None:
        values = {**values, "terminal_sequence": terminal.sequence, "last_sequence": terminal.last_sequence,
                  "lease_owner": terminal.lease_owner, "lease_seconds": float(terminal.lease_seconds),
                  "first_partition": terminal.first_partition, "first_offset": terminal.first_offset}
    written = await rows.row(plain if terminal is None else with_terminal, values)
    assert written is not None, "the settlement statement returns one row"
    return written


async def settle_run_usage(
    session: Executor,
    run_id: uuid.UUID | str,
    status: RunStatus | str,
    output_tokens: int,
    cached_input_tokens: int,
    detail: str | None,
    *,
    input_tokens: int | None = None,
    owned_by_epoch: int | None = None,
    terminal: TerminalFix | None = None,
) -> SettledUsage | None:
    """settle_run, returning the settlement it made (what `settled_usage` would read back), or
    None if the run was already settled. Two statements, whoever settles: the run read (row-locked),
    then the entry, the run and the budget written at once.

    `owned_by_epoch`: settle only while the run is active under that lease epoch (NotOwned otherwise,
    nothing written). `terminal`: fix the terminal event's sequence and the publisher's lease with it.
    `session`: the caller's transaction, a SQLAlchemy session or a hot connection's rows_of (ledger/pg.py)."""
    run_uuid = uuid.UUID(str(run_id))
    final = RunStatus(status)
    if final not in TERMINAL_STATUSES:
        raise SettlementError(f"settle_run needs a terminal status, got {final.value}")

    rows = rows_of(session)
    if owned_by_epoch is not None:
        return await _settle_owned(rows, run_uuid, final, output_tokens, cached_input_tokens, detail,
                                   input_tokens, owned_by_epoch, terminal)
    run = await rows.row(_READ_ANY, {"run_id": run_uuid})
    if run is None:
        raise SettlementError(f"no run {run_uuid}")

    if input_tokens is None:
        input_tokens = run["input_tokens"] if run["replica"] is not None else 0
    charged_input = input_tokens
    _check_counts(run_uuid, run["input_tokens"], run["max_output_tokens"], charged_input, cached_input_tokens,
                  output_tokens)
    rates = _Rates(run["price_input_per_m_micros"], run["price_cached_input_per_m_micros"],
                   run["price_output_per_m_micros"])
    cost = cost_micros(rates, charged_input, cached_input_tokens, output_tokens)

    values: dict[str, object] = {
        "entry_id": uuid.uuid4(), "run_id": run_uuid, "tenant_id": run["tenant_id"],
        "model_version": run["model_version"], "input_tokens": charged_input,
        "cached_input_tokens": cached_input_tokens, "output_tokens": output_tokens, "cost_micros": cost,
        "api_key_id": run["api_key_id"], "price_card_id": run["price_card_id"],
        "route_reason": run["route_reason"], "worker_pool": run["worker_pool"],
        "quality_tier": run["quality_tier"], "status": final.value, "detail": detail,
        "used_tokens": charged_input + output_tokens,
    }
    written = await _write(rows, (_SETTLE, _SETTLE_TERMINAL), values, terminal)
    if written["settled_at"] is None:
        return None
    assert written["budgets"] == 1, (
        f"no budget row for tenant {run['tenant_id']} in the period run {run_uuid} was admitted in:"
        " a reservation was lost")
    return SettledUsage(run_id=run_uuid, status=final, input_tokens=charged_input,
                        cached_input_tokens=cached_input_tokens, output_tokens=output_tokens,
                        cost_micros=cost, settled_at=written["settled_at"])


@dataclass(frozen=True, slots=True)
class _Rates:
    """The price card a run settles at, as the settlement read found it (pricing.PriceCard)."""

    price_input_per_m_micros: int
    price_cached_input_per_m_micros: int
    price_output_per_m_micros: int


def _check_counts(run_id: uuid.UUID, run_input_tokens: int, max_output_tokens: int, input_tokens: int,
                  cached_input_tokens: int, output_tokens: int) -> None:
    if not 0 <= input_tokens <= run_input_tokens:
        raise SettlementError(f"input_tokens {input_tokens} outside 0..{run_input_tokens} for run {run_id}")
    if not 0 <= cached_input_tokens <= input_tokens:
        raise SettlementError(
            f"cached_input_tokens {cached_input_tokens} outside 0..{input_tokens} for run {run_id}"
        )
    if not 0 <= output_tokens <= max_output_tokens:
        raise SettlementError(
            f"output_tokens {output_tokens} outside 0..{max_output_tokens} (the run's cap)"
            f" for run {run_id}"
        )


async def settled_usage(session: AsyncSession, run_id: uuid.UUID | str) -> SettledUsage | None:
    """The run's settlement, if it has one (e.g. to put usage into the TERMINAL event)."""
    row = (
        await session.execute(
            select(UsageEntry, Run.status)
            .join(Run, Run.id == UsageEntry.run_id)
            .where(UsageEntry.run_id == uuid.UUID(str(run_id)))
        )
    ).one_or_none()
    if row is None:
        return None
    entry, status = row
    return SettledUsage(
        run_id=entry.run_id,
        status=RunStatus(status),
        input_tokens=entry.input_tokens,
        cached_input_tokens=entry.cached_input_tokens,
        output_tokens=entry.output_tokens,
        cost_micros=entry.cost_micros,
        settled_at=entry.settled_at,
    )
