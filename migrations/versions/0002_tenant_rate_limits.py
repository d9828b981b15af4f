"""Tenant limits shared by all admission instances: concurrent runs and tokens per minute.

Both are nullable (NULL = unlimited), so existing tenants keep working unchanged. The two indexes
serve admission's checks: the tenant's runs of the last 60 s (tokens-per-minute window) and the
tenant's runs not yet terminal (concurrent-run count).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 15:15:46
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ACTIVE = sa.text("status IN ('ACCEPTED', 'QUEUED', 'RUNNING')")


def upgrade() -> None:
    op.add_column('tenants', sa.Column('max_concurrent_runs', sa.Integer(), nullable=True))
    op.add_column('tenants', sa.Column('tokens_per_minute', sa.BigInteger(), nullable=True))
    op.create_check_constraint(
        op.f('ck_tenants_limits_positive'),
        'tenants',
        '(max_concurrent_runs IS NULL OR max_concurrent_runs > 0)'
        ' AND (tokens_per_minute IS NULL OR tokens_per_minute > 0)',
    )
    op.create_index('ix_runs_tenant_id_created_at', 'runs', ['tenant_id', 'created_at'], unique=False)
    op.create_index('ix_runs_tenant_id_active', 'runs', ['tenant_id'], unique=False, postgresql_where=ACTIVE)


def downgrade() -> None:
    op.drop_index('ix_runs_tenant_id_active', table_name='runs', postgresql_where=ACTIVE)
    op.drop_index('ix_runs_tenant_id_created_at', table_name='runs')
    op.drop_constraint(op.f('ck_tenants_limits_positive'), 'tenants', type_='check')
    op.drop_column('tenants', 'tokens_per_minute')
    op.drop_column('tenants', 'max_concurrent_runs')
