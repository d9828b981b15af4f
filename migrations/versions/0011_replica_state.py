"""Replica state in the durable registry: serving | warm | draining (sluice/autoscaler).

The autoscaler registers a replica it started as `warm` (loaded, health-checked, routed nothing),
promotes it to `serving`, and drains it (`draining`: no new runs, the running ones finish) before
it stops it. Routing processes send new runs only to `serving` replicas. Existing rows serve.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-30 09:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("replicas", sa.Column("state", sa.Text(), server_default="serving", nullable=False))


def downgrade() -> None:
    op.drop_column("replicas", "state")
