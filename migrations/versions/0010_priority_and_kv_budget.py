"""Priority classes and the per-tenant GPU-memory (KV token) budget (issue 14 points 4-5).

- runs.priority: 'interactive' (default) or 'batch' (sluice/traffic/priority.py).
- tenants.batch_allowed: may this tenant submit batch runs (default false).
- tenants.kv_token_budget: cap on the KV tokens (prompt + output cap) its claimed, unfinished runs
  hold at once across the pool; NULL = no cap (sluice/traffic/gpu_budget.py).
- ix_runs_model_version_priority_accepted replaces ix_runs_model_version_accepted: admission counts
  each class's backlog of one model separately, and the claim takes one class at a time, oldest
  first (ix_runs_priority_created_at_accepted).
- ix_runs_model_version_queued_at: the ladder's measured drain rate counts a model's runs claimed
  in the last seconds (read only on the shedding path).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30 09:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACCEPTED = sa.text("status = 'ACCEPTED'")
CLAIMED = sa.text("queued_at IS NOT NULL")


def upgrade() -> None:
    op.add_column("runs", sa.Column("priority", sa.Text(), server_default="interactive", nullable=False))
    op.create_check_constraint("ck_runs_priority_known", "runs", "priority IN ('interactive', 'batch')")
    op.add_column("tenants", sa.Column("batch_allowed", sa.Boolean(), server_default=sa.text("false"),
                                       nullable=False))
    op.add_column("tenants", sa.Column("kv_token_budget", sa.BigInteger(), nullable=True))
    op.create_check_constraint("ck_tenants_kv_token_budget_positive", "tenants",
                               "kv_token_budget IS NULL OR kv_token_budget > 0")
    op.create_index("ix_runs_model_version_priority_accepted", "runs", ["model_version", "priority"],
                    postgresql_where=ACCEPTED)
    op.create_index("ix_runs_priority_created_at_accepted", "runs", ["priority", "created_at"],
                    postgresql_where=ACCEPTED)
    op.create_index("ix_runs_model_version_queued_at", "runs", ["model_version", "queued_at"],
                    postgresql_where=CLAIMED)
    op.drop_index("ix_runs_model_version_accepted", table_name="runs", postgresql_where=ACCEPTED)


def downgrade() -> None:
    op.create_index("ix_runs_model_version_accepted", "runs", ["model_version"], postgresql_where=ACCEPTED)
    op.drop_index("ix_runs_model_version_queued_at", table_name="runs", postgresql_where=CLAIMED)
    op.drop_index("ix_runs_priority_created_at_accepted", table_name="runs", postgresql_where=ACCEPTED)
    op.drop_index("ix_runs_model_version_priority_accepted", table_name="runs", postgresql_where=ACCEPTED)
    op.drop_constraint("ck_tenants_kv_token_budget_positive", "tenants", type_="check")
    op.drop_column("tenants", "kv_token_budget")
    op.drop_column("tenants", "batch_allowed")
    op.drop_constraint("ck_runs_priority_known", "runs", type_="check")
    op.drop_column("runs", "priority")
