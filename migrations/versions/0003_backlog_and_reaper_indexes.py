"""Partial indexes for admission's backlog count and the reaper's unpublished-terminal scan.

- ix_runs_model_version_accepted: runs WHERE status = 'ACCEPTED', by model_version. Admission counts
  a model's unclaimed runs (with a LIMIT) on every Submit to shed load; the index holds only runs
  still waiting for a routing worker, so the count's cost is bounded by the backlog, not by runs.
- ix_runs_lease_expires_at_unpublished: runs WHERE terminal_published = false AND terminal_sequence
  IS NOT NULL, by lease_expires_at. The reaper looks for settled runs whose TERMINAL event was never
  confirmed; almost every run leaves this set within milliseconds, so the index stays tiny.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 16:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACCEPTED = sa.text("status = 'ACCEPTED'")
UNPUBLISHED_TERMINAL = sa.text("terminal_published = false AND terminal_sequence IS NOT NULL")


def upgrade() -> None:
    op.create_index('ix_runs_model_version_accepted', 'runs', ['model_version'], unique=False,
                    postgresql_where=ACCEPTED)
    op.create_index('ix_runs_lease_expires_at_unpublished', 'runs', ['lease_expires_at'], unique=False,
                    postgresql_where=UNPUBLISHED_TERMINAL)


def downgrade() -> None:
    op.drop_index('ix_runs_lease_expires_at_unpublished', table_name='runs',
                  postgresql_where=UNPUBLISHED_TERMINAL)
    op.drop_index('ix_runs_model_version_accepted', table_name='runs', postgresql_where=ACCEPTED)
