"""Trace context on runs: the W3C traceparent of the Submit span (services/telemetry.py).

The gateway that admits a run writes it; the routing worker that claims the run opens its spans
(claim, replica stream, settlement) under it, so one run is one trace across processes. NULL when
the gateway does not trace.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30 09:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("traceparent", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "traceparent")
