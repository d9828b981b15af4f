"""Runs.GetRun and Runs.Cancel on raw asyncpg connections (issue 9: no ORM on the gateway's run calls).

    get_run_view      API key → tenant, and that tenant's run with its settled usage (or, in flight,
                      its model's rates), one autocommit SELECT; the key's last use is recorded at
                      most once a minute (one more statement, as ApiKeyRepository.caller does)
    request_cancel    QUEUED/RUNNING → cancel requested, one autocommit UPDATE whose RETURNING
                      carries the NOTIFY to the driving worker (delivered at its commit)
    run_status        the run's status and whether a cancel was requested; row-locked inside
                      Cancel's transaction for a run still ACCEPTED (settled there, as before)

The key is found as the other hot reads find it (ledger/admission_sql.py, ledger/runs_sql.py): an
unsalted key by its hash, a salted one by its public prefix, then checked against its salted hash
in Python. No row: an unknown, revoked or expired key; a row without a run: a run this tenant does
not have (another tenant's run reads the same as none).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.ledger.keys import matches, salted_prefix, unsalted_hash
from sluice.ledger.models import KeyScope, RunStatus
from sluice.ledger.pg import Executor, Statement, rows_of
from sluice.ledger.pricing import cost_micros
from sluice.ledger.repositories import LAST_USED_RESOLUTION
from sluice.ledger.routes import route_from_columns

from sluice.traffic.route import RouteRecord

_VIEW = Statement.of("""
SELECT k.id AS key_id, k.key_hash, k.key_salt, k.scope,
       (k.last_used_at IS NULL
        OR k.last_used_at < now() - CAST(:last_used_resolution AS interval)) AS key_stale,
       r.id, r.request_key, r.model_version, r.status, r.replica, r.input_tokens, r.max_output_tokens,
       r.created_at, r.started_at, r.finished_at, r.deadline_at, r.last_sequence, r.terminal_sequence,
       r.detail, r.cached_input_tokens, r.output_tokens, r.priority, r.requested_model, r.route_reason,
       r.worker_pool, r.quality_tier, r.fallback_from, r.route_detail,
       r.cancel_requested_at IS NOT NULL AS cancel_requested,
       u.run_id AS settled, u.input_tokens AS settled_input_tokens,
       u.cached_input_tokens AS settled_cached_input_tokens, u.output_tokens AS settled_output_tokens,
       u.cost_micros AS settled_cost_micros,
       m.price_input_per_m_micros, m.price_cached_input_per_m_micros, m.price_output_per_m_micros
FROM api_keys k
LEFT JOIN runs r ON r.id = :run_id AND r.tenant_id = k.tenant_id
LEFT JOIN usage_entries u ON u.run_id = r.id
LEFT JOIN models m ON m.version = r.model_version
WHERE ((k.key_hash = :key_hash AND k.key_salt IS NULL)
       OR (k.key_prefix = :key_prefix AND k.key_salt IS NOT NULL))
  AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now())
""")

# ApiKeyRepository.caller's touch_key: never waits on a concurrent writer of the same key row.
_TOUCH_KEY = Statement.of("""
UPDATE api_keys SET last_used_at = now()
 WHERE id IN (SELECT id FROM api_keys WHERE id = :key_id FOR UPDATE SKIP LOCKED)
""")

_REQUEST_CANCEL = Statement.of("""
UPDATE runs SET cancel_requested_at = now()
 WHERE id = :run_id AND status IN ('QUEUED', 'RUNNING') AND cancel_requested_at IS NULL
RETURNING status, pg_notify(:channel, :payload)
""")

_STATUS = """
SELECT status, cancel_requested_at IS NOT NULL AS cancel_requested FROM runs WHERE id = :run_id
"""
_READ_STATUS = Statement.of(_STATUS)
_LOCK_STATUS = Statement.of(_STATUS + "FOR UPDATE")


@dataclass(frozen=True, slots=True)
class Usage:
    """What a run has consumed: settled (reconciled), or so far (in flight, priced as settlement will)."""

    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    cost_micros: int


@dataclass(frozen=True, slots=True)
class RunView:
    """A run as GetRun reports it."""

    run_id: uuid.UUID
    request_key: str
    model_version: str
    status: RunStatus
    replica: str | None
    input_tokens: int
    max_output_tokens: int
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    deadline_at: dt.datetime
    # The terminal sequence once fixed (with the settlement, before the event is published), else the
    # durable progress: a client holding the terminal event and GetRun agree (services/runs.py).
    cursor: int
    detail: str | None
    cached_input_tokens: int
    usage: Usage
    route: RouteRecord | None
    priority: str


@dataclass(frozen=True, slots=True)
class CallerRun:
    """What a Runs call's key and run id found."""

    authenticated: bool              # the key is known, not revoked and not expired
    scope: KeyScope = KeyScope.TENANT
    run: RunView | None = None       # None: no such run for this key's tenant
    status: RunStatus | None = None  # the run's (also when only the status was read)
    cancel_requested: bool = False


async def get_run_view(executor: Executor, key: str, run_id: uuid.UUID | None) -> CallerRun:
    rows = rows_of(executor)
    found = await rows.rows(_VIEW, {"key_hash": unsalted_hash(key), "key_prefix": salted_prefix(key),
                                    "run_id": run_id, "last_used_resolution": LAST_USED_RESOLUTION})
    row = next((row for row in found if matches(key, row["key_hash"], row["key_salt"])), None)
    if row is None:
        return CallerRun(False)
    if row["key_stale"]:
        await rows.row(_TOUCH_KEY, {"key_id": row["key_id"]})
    scope = KeyScope(row["scope"])
    if row["id"] is None:
        return CallerRun(True, scope)
    view = _view_of(row)
    return CallerRun(True, scope, view, view.status, bool(row["cancel_requested"]))


def _view_of(row: Mapping[str, Any]) -> RunView:
    return RunView(
        run_id=row["id"], request_key=row["request_key"], model_version=row["model_version"],
        status=RunStatus(row["status"]), replica=row["replica"], input_tokens=row["input_tokens"],
        max_output_tokens=row["max_output_tokens"], created_at=row["created_at"],
        started_at=row["started_at"], finished_at=row["finished_at"], deadline_at=row["deadline_at"],
        cursor=row["terminal_sequence"] if row["terminal_sequence"] is not None else row["last_sequence"],
        detail=row["detail"], cached_input_tokens=row["cached_input_tokens"], usage=_usage_of(row),
        route=route_from_columns(row["model_version"], row["worker_pool"], row["quality_tier"],
                                 row["route_reason"], row["requested_model"], row["fallback_from"],
                                 row["route_detail"]),
        priority=row["priority"])


@dataclass(frozen=True, slots=True)
class _Rates:
    price_input_per_m_micros: int
    price_cached_input_per_m_micros: int
    price_output_per_m_micros: int


def _usage_of(row: Mapping[str, Any]) -> Usage:
    if row["settled"] is not None:
        return Usage(row["settled_input_tokens"], row["settled_cached_input_tokens"],
                     row["settled_output_tokens"], row["settled_cost_micros"])
    # In flight: the prompt is charged once a replica took the run; output so far is what is durable.
    charged_input = row["input_tokens"] if row["replica"] is not None else 0
    cached = min(row["cached_input_tokens"], charged_input)
    rates = _Rates(row["price_input_per_m_micros"], row["price_cached_input_per_m_micros"],
                   row["price_output_per_m_micros"])
    return Usage(charged_input, row["cached_input_tokens"], row["output_tokens"],
                 cost_micros(rates, charged_input, cached, row["output_tokens"]))


async def request_cancel(executor: Executor, run_id: uuid.UUID, channel: str) -> RunStatus | None:
    """Record the cancel of a QUEUED or RUNNING run not yet asked to cancel, and NOTIFY `channel`
    with its id (at commit); its status, or None when it was not such a run (nothing written)."""
    row = await rows_of(executor).row(_REQUEST_CANCEL, {"run_id": run_id, "channel": channel,
                                                        "payload": str(run_id)})
    return None if row is None else RunStatus(row["status"])


async def run_status(executor: Executor, run_id: uuid.UUID, *, lock: bool = False) -> tuple[RunStatus, bool]:
    """(status, cancel already requested) of the run; `lock`: row-locked until the caller's
    transaction ends."""
    row = await rows_of(executor).row(_LOCK_STATUS if lock else _READ_STATUS, {"run_id": run_id})
    assert row is not None, f"run {run_id} vanished"
    return RunStatus(row["status"]), bool(row["cancel_requested"])
