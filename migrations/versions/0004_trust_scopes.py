"""Trust scopes for prefix reuse (DESIGN.md "Trust scopes").

- tenants.shared_cache_scope: the name of a shared scope this tenant opts into for public system
  prompts (NULL, the default: the tenant's own scope; nothing is shared with other tenants).
- runs.cache_scope: the scope a run's prompt may reuse KV blocks in, fixed at admission
  ("tenant:<tenant id>" or "shared:<name>"). NULL for runs admitted before this revision, which
  routing treats as their tenant's own scope.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 06:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("shared_cache_scope", sa.Text(), nullable=True))
    op.create_check_constraint("shared_cache_scope_named", "tenants",
                               "shared_cache_scope IS NULL OR length(shared_cache_scope) BETWEEN 1 AND 128")
    op.add_column("runs", sa.Column("cache_scope", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "cache_scope")
    op.drop_constraint("shared_cache_scope_named", "tenants", type_="check")
    op.drop_column("tenants", "shared_cache_scope")
