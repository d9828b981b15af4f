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
from collections.abc import Mapping, Sequence
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


# The settlements of runs their lease holder ends (owned_by_epoch), any number of them in ONE
# statement and so one round trip and one commit (the routing worker's runs end together: a replica's
# step ends every run in its batch; ledger/batching.py). Per run (one row of `unnest` each): the run
# read row-locked under its epoch, the charge and its cost computed in SQL (as pricing.cost_micros_sql:
# every term non-negative, so + unit - 1 before the integer division rounds up as cost_micros does),
# then the entry and the run written as _WRITE does, only when its counts are possible (else nothing
# of that run is written, and its caller raises SettlementError). The budgets take the sum of the
# runs settled per tenant and period. Rows are locked in one order (runs by id, then budgets by tenant
# and period), so two such statements never wait on each other in a cycle. `id = ANY(ids)` keeps the
# generic plan on runs' primary key (joined to `unnest` alone, runs was scanned whole).
# A NULL terminal_sequence: no terminal fix for that run (its terminal columns and lease unchanged).
_OWNED_MANY = Statement.of(("""
WITH p AS (
    SELECT * FROM unnest(CAST(:run_ids AS uuid[]), CAST(:epochs AS bigint[]), CAST(:entry_ids AS uuid[]),
                         CAST(:statuses AS text[]), CAST(:input_tokens AS integer[]),
                         CAST(:cached_input_tokens AS integer[]), CAST(:output_tokens AS integer[]),
                         CAST(:details AS text[]), CAST(:terminal_sequences AS bigint[]),
                         CAST(:last_sequences AS bigint[]), CAST(:lease_owners AS text[]),
                         CAST(:lease_seconds AS float8[]), CAST(:first_partitions AS integer[]),
                         CAST(:first_offsets AS bigint[]))
           AS p(run_id, epoch, entry_id, status, input_override, cached, output, detail, terminal_sequence,
                last_sequence, lease_owner, lease_seconds, first_partition, first_offset)
), run AS (
    SELECT r.id, r.tenant_id, r.model_version, r.input_tokens, r.max_output_tokens, r.reserved_tokens,
           r.reserved_cost_micros, r.api_key_id, r.price_card_id, r.route_reason, r.worker_pool,
           r.quality_tier, r.created_at, p.*,
           COALESCE(p.input_override,
                    CASE WHEN r.replica IS NULL THEN 0 ELSE r.input_tokens END) AS charged_input,
           COALESCE(c.price_input_per_m_micros, m.price_input_per_m_micros) AS price_input,
           COALESCE(c.price_cached_input_per_m_micros, m.price_cached_input_per_m_micros) AS price_cached,
           COALESCE(c.price_output_per_m_micros, m.price_output_per_m_micros) AS price_output
      FROM p
      JOIN runs r ON r.id = p.run_id
      JOIN models m ON m.version = r.model_version
      LEFT JOIN price_cards c ON c.id = r.price_card_id
     WHERE r.id = ANY(CAST(:run_ids AS uuid[])) AND r.lease_epoch = p.epoch AND r.status IN {owned}
     ORDER BY r.id
       FOR UPDATE OF r
), charge AS (
    SELECT run.*,
           (0 <= charged_input AND charged_input <= input_tokens AND 0 <= cached AND cached <= charged_input
            AND 0 <= output AND output <= max_output_tokens) AS possible,
           (CAST(charged_input - cached AS bigint) * price_input + CAST(cached AS bigint) * price_cached
            + CAST(output AS bigint) * price_output + {unit_less_one}) / {unit} AS cost_micros,
           CAST(date_trunc('month', timezone('UTC', created_at)) AS date) AS period
      FROM run
), entry AS (
""" + _INSERT_ENTRY + """
    SELECT entry_id, id, tenant_id, model_version, date(timezone('UTC', now())), charged_input, cached,
           output, cost_micros, api_key_id, price_card_id, route_reason, worker_pool, quality_tier
      FROM charge WHERE possible
    ON CONFLICT (run_id) DO NOTHING
    RETURNING run_id, settled_at
), settled AS (
    SELECT charge.* FROM charge JOIN entry ON entry.run_id = charge.id
), finished AS (
    UPDATE runs
       SET status = s.status, finished_at = now(), output_tokens = s.output, cached_input_tokens = s.cached,
           detail = s.detail,
           terminal_sequence = COALESCE(s.terminal_sequence, runs.terminal_sequence),
           last_sequence = COALESCE(s.last_sequence, runs.last_sequence),
           lease_owner = COALESCE(s.lease_owner, runs.lease_owner),
           lease_expires_at = CASE WHEN s.terminal_sequence IS NULL THEN runs.lease_expires_at
                                   ELSE now() + make_interval(secs => s.lease_seconds) END,
           event_partition = COALESCE(runs.event_partition, s.first_partition),
           event_first_offset = COALESCE(runs.event_first_offset, s.first_offset)
      FROM settled s
     WHERE runs.id = s.id
    RETURNING runs.id
), owed AS (
    SELECT tenant_id, period, sum(reserved_tokens) AS reserved_tokens,
           sum(reserved_cost_micros) AS reserved_cost_micros, sum(charged_input + output) AS used_tokens,
           sum(cost_micros) AS used_cost_micros
      FROM settled GROUP BY tenant_id, period
), budget_rows AS (
    SELECT b.tenant_id, b.period_start FROM budgets b JOIN owed o
        ON b.tenant_id = o.tenant_id AND b.period_start = o.period
     ORDER BY b.tenant_id, b.period_start
       FOR NO KEY UPDATE OF b
), budget AS (
    UPDATE budgets b
       SET reserved_tokens = b.reserved_tokens - o.reserved_tokens,
           reserved_cost_micros = b.reserved_cost_micros - o.reserved_cost_micros,
           used_tokens = b.used_tokens + o.used_tokens,
           used_cost_micros = b.used_cost_micros + o.used_cost_micros
      FROM owed o, budget_rows l
     WHERE b.tenant_id = o.tenant_id AND b.period_start = o.period
       AND l.tenant_id = o.tenant_id AND l.period_start = o.period
    RETURNING b.tenant_id, b.period_start
)
SELECT p.run_id, charge.id IS NOT NULL AS owned, charge.possible, charge.tenant_id, charge.input_tokens,
       charge.max_output_tokens, charge.charged_input, charge.cost_micros, entry.settled_at,
       EXISTS (SELECT 1 FROM budget WHERE budget.tenant_id = charge.tenant_id
                                      AND budget.period_start = charge.period) AS budgeted,
       EXISTS (SELECT 1 FROM finished WHERE finished.id = p.run_id) AS finished
  FROM p LEFT JOIN charge ON charge.id = p.run_id LEFT JOIN entry ON entry.run_id = p.run_id
""").format(owned=_RUN_STATUSES_OWNED, unit=TOKENS_PER_PRICE_UNIT,
                                          unit_less_one=TOKENS_PER_PRICE_UNIT - 1))


@dataclass(frozen=True, slots=True)
class OwnedSettlement:
    """One run its lease holder ends: what settle_run_usage(owned_by_epoch=...) is given."""

    run_id: uuid.UUID
    epoch: int                       # the holder's lease epoch: settled only while the run is active under it
    status: RunStatus                # terminal
    output_tokens: int
    cached_input_tokens: int
    detail: str | None
    input_tokens: int | None = None  # the charged prompt, when not the default (settle_run)
    terminal: TerminalFix | None = None


@dataclass(frozen=True, slots=True)
class OwnedSettled:
    """What settle_owned_many did for one run."""

    owned: bool                      # False: not active under that epoch (nothing written)
    usage: SettledUsage | None       # None: not owned, impossible, or settled before
    impossible: SettlementError | None = None   # counts no run could produce (nothing written)


async def settle_owned_many(executor: Executor, settlements: Sequence[OwnedSettlement]) -> list[OwnedSettled]:
    """Settle every run of `settlements` its lease holder ends, in one statement (_OWNED_MANY); per
    run, in order, what was done. A run settled before is left alone (usage None)."""
    # A run twice would be charged twice in its budget's sum: each driver has one settlement in flight.
    assert len({item.run_id for item in settlements}) == len(settlements), \
        "a run settled twice in one statement"
    fixes = [item.terminal for item in settlements]
    found = await rows_of(executor).rows(_OWNED_MANY, {
        "run_ids": [item.run_id for item in settlements], "epochs": [item.epoch for item in settlements],
        "entry_ids": [uuid.uuid4() for _ in settlements],
        "statuses": [RunStatus(item.status).value for item in settlements],
        "input_tokens": [item.input_tokens for item in settlements],
        "cached_input_tokens": [item.cached_input_tokens for item in settlements],
        "output_tokens": [item.output_tokens for item in settlements],
        "details": [item.detail for item in settlements],
        "terminal_sequences": [None if fix is None else fix.sequence for fix in fixes],
        "last_sequences": [None if fix is None else fix.last_sequence for fix in fixes],
        "lease_owners": [None if fix is None else fix.lease_owner for fix in fixes],
        "lease_seconds": [None if fix is None else float(fix.lease_seconds) for fix in fixes],
        "first_partitions": [None if fix is None else fix.first_partition for fix in fixes],
        "first_offsets": [None if fix is None else fix.first_offset for fix in fixes]})
    by_run = {row["run_id"]: row for row in found}
    return [_owned_settled(item, by_run[item.run_id]) for item in settlements]


def _owned_settled(item: OwnedSettlement, written: Mapping[str, Any]) -> OwnedSettled:
    if not written["owned"]:
        return OwnedSettled(False, None)
    if not written["possible"]:
        try:
            _check_counts(item.run_id, written["input_tokens"], written["max_output_tokens"],
                          written["charged_input"], item.cached_input_tokens, item.output_tokens)
        except SettlementError as impossible:
            return OwnedSettled(True, None, impossible)
        raise AssertionError(f"run {item.run_id}: the ledger refused counts that _check_counts accepts")
    if written["settled_at"] is None:
        return OwnedSettled(True, None)
    assert written["budgeted"] and written["finished"], (
        f"no budget row for tenant {written['tenant_id']} in the period run {item.run_id} was admitted in:"
        " a reservation was lost")
    return OwnedSettled(True, SettledUsage(
        run_id=item.run_id, status=RunStatus(item.status), input_tokens=written["charged_input"],
        cached_input_tokens=item.cached_input_tokens, output_tokens=item.output_tokens,
        cost_micros=int(written["cost_micros"]), settled_at=written["settled_at"]))


async def _settle_owned(rows: Rows, item: OwnedSettlement) -> SettledUsage | None:
    """settle_run_usage(owned_by_epoch=...): settle_owned_many for one run."""
    settled = (await settle_owned_many(rows, [item]))[0]
    if not settled.owned:
        raise NotOwned(f"run {item.run_id} is not active under lease epoch {item.epoch}")
    if settled.impossible is not None:
        raise settled.impossible
    return settled.usage


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
        return await _settle_owned(rows, OwnedSettlement(run_uuid, owned_by_epoch, final, output_tokens,
                                                         cached_input_tokens, detail, input_tokens, terminal))
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
