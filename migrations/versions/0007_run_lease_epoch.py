"""Lease epoch on runs: the fencing token of a run's ownership (DESIGN.md "Leases and fencing").

`runs.lease_epoch` grows by one each time a routing process takes a run (the claim, a reaper
taking over an expired lease, a reaper republishing a terminal event). Every ledger write of a
driver is conditioned on the epoch it was granted, and every event it publishes carries it, so a
process whose lease was taken over can neither move the run nor add events readers accept.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 07:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("lease_epoch", sa.BigInteger(), server_default="0", nullable=False))


def downgrade() -> None:
    op.drop_column("runs", "lease_epoch")
