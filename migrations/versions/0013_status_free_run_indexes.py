"""RUNNING as a HOT update: no index of runs keys on or filters by `status`; usage entries keep only
their run's foreign key.

A run's QUEUED -> RUNNING write changes `status`, started_at and where its events start. PostgreSQL
updates a row in place (HOT: no new entry in any index) only when no column an index keys on or
filters by changes. `status` was in four of runs' nine indexes, so every RUNNING mark inserted six
index entries. The partial indexes now say "not yet claimed" and "not yet finished" with the columns
whose writes already mean it (migration 0012 did the same for lease renewals):

- ix_runs_status_created_at is dropped. Its readers: the reaper's expired leases, the replicas' run
  counts and the active-reservation totals read the unfinished runs (ix_runs_tenant_id_unfinished);
  the canary guard reads a model's runs by queued_at (ix_runs_model_version_queued_at: every run it
  judges, COMPLETED, FAILED or INTERRUPTED, was claimed); reconcile scans a whole period anyway.
- ix_runs_tenant_id_active (status IN ACCEPTED, QUEUED, RUNNING) -> ix_runs_tenant_id_unfinished
  (finished_at IS NULL).
- ix_runs_model_version_priority_accepted and ix_runs_priority_created_at_accepted (status =
  'ACCEPTED') -> ..._unclaimed (queued_at IS NULL AND finished_at IS NULL).

Each new predicate holds for every row the old one held for (a run is inserted ACCEPTED with neither
time set; the claim sets queued_at as it leaves ACCEPTED; only settlement sets finished_at, with a
terminal status, and nothing leaves a terminal status), so an index may hold a few more rows, never
fewer: every query keeps its status condition beside the predicate it names to use the index.

usage_entries' foreign keys to tenants, models and price_cards are dropped: an entry's tenant, model
and price card are copied from its run in the settlement statement, the run's own foreign keys hold
them, and runs are never deleted; each key cost the settlement a lookup that share-locked the
parent row (every run's settlement locked the one models row). The run's key stays.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01 03:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0013'
down_revision: str | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACTIVE = sa.text("status IN ('ACCEPTED', 'QUEUED', 'RUNNING')")
ACCEPTED = sa.text("status = 'ACCEPTED'")
UNFINISHED = sa.text("finished_at IS NULL")
UNCLAIMED = sa.text("queued_at IS NULL AND finished_at IS NULL")
# usage_entries column -> (parent table, parent column)
ENTRY_KEYS = {"tenant_id": ("tenants", "id"), "model_version": ("models", "version"),
              "price_card_id": ("price_cards", "id")}


def upgrade() -> None:
    op.create_index("ix_runs_tenant_id_unfinished", "runs", ["tenant_id"], postgresql_where=UNFINISHED)
    op.create_index("ix_runs_model_version_priority_unclaimed", "runs", ["model_version", "priority"],
                    postgresql_where=UNCLAIMED)
    op.create_index("ix_runs_priority_created_at_unclaimed", "runs", ["priority", "created_at"],
                    postgresql_where=UNCLAIMED)
    op.drop_index("ix_runs_status_created_at", table_name="runs")
    op.drop_index("ix_runs_tenant_id_active", table_name="runs", postgresql_where=ACTIVE)
    op.drop_index("ix_runs_model_version_priority_accepted", table_name="runs", postgresql_where=ACCEPTED)
    op.drop_index("ix_runs_priority_created_at_accepted", table_name="runs", postgresql_where=ACCEPTED)
    for column, (table, _) in ENTRY_KEYS.items():
        op.drop_constraint(f"fk_usage_entries_{column}_{table}", "usage_entries", type_="foreignkey")


def downgrade() -> None:
    for column, (table, key) in ENTRY_KEYS.items():
        op.create_foreign_key(f"fk_usage_entries_{column}_{table}", "usage_entries", table, [column], [key])
    op.create_index("ix_runs_priority_created_at_accepted", "runs", ["priority", "created_at"],
                    postgresql_where=ACCEPTED)
    op.create_index("ix_runs_model_version_priority_accepted", "runs", ["model_version", "priority"],
                    postgresql_where=ACCEPTED)
    op.create_index("ix_runs_tenant_id_active", "runs", ["tenant_id"], postgresql_where=ACTIVE)
    op.create_index("ix_runs_status_created_at", "runs", ["status", "created_at"])
    op.drop_index("ix_runs_priority_created_at_unclaimed", table_name="runs", postgresql_where=UNCLAIMED)
    op.drop_index("ix_runs_model_version_priority_unclaimed", table_name="runs", postgresql_where=UNCLAIMED)
    op.drop_index("ix_runs_tenant_id_unfinished", table_name="runs", postgresql_where=UNFINISHED)
