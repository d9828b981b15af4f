"""Lease renewals as HOT updates: the reaper's unpublished-terminal index no longer keys on
lease_expires_at, and runs pages keep room for new row versions (fillfactor 70).

A renewal (services/routing/leases.py) rewrites lease_expires_at, last_sequence and output_tokens of
every run a worker holds, each interval. PostgreSQL can update a row in place on its page (a HOT
update: no new entry in any of runs' nine indexes) only when no indexed column changes and the page
has room. lease_expires_at was the key of ix_runs_lease_expires_at_unpublished, so every renewal of
every run inserted nine index entries (~105 us of backend CPU per run renewed, measured on the bench's
stream-256 phase, about a third of PostgreSQL's share there). That index exists for the reaper's scan
of settled runs whose TERMINAL was never confirmed published (terminal_published = false AND
terminal_sequence IS NOT NULL): a handful of rows at any time, so keyed by id it serves the same scan,
lease_expires_at < now() checked on those few rows. fillfactor only shapes pages written from now on.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-30 18:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0012'
down_revision: str | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNPUBLISHED = sa.text("terminal_published = false AND terminal_sequence IS NOT NULL")


def upgrade() -> None:
    op.drop_index("ix_runs_lease_expires_at_unpublished", table_name="runs", postgresql_where=UNPUBLISHED)
    op.create_index("ix_runs_id_unpublished", "runs", ["id"], unique=False, postgresql_where=UNPUBLISHED)
    op.execute("ALTER TABLE runs SET (fillfactor = 70)")


def downgrade() -> None:
    op.execute("ALTER TABLE runs RESET (fillfactor)")
    op.drop_index("ix_runs_id_unpublished", table_name="runs", postgresql_where=UNPUBLISHED)
    op.create_index("ix_runs_lease_expires_at_unpublished", "runs", ["lease_expires_at"], unique=False,
                    postgresql_where=UNPUBLISHED)
