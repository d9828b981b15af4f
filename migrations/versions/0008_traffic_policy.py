"""Traffic policy (issue 14, points 1-3): the routing decision on runs and usage entries, tenants'
permitted fallbacks, and canaries with their guardrails.

- runs: requested_model, route_reason (requested | alias | canary | fallback), worker_pool,
  quality_tier, fallback_from, route_detail. Existing runs keep NULL (admitted before decisions
  were recorded); their pool and tier are still their model's.
- usage_entries: route_reason, worker_pool, quality_tier, copied from the run at settlement.
- tenant_fallbacks: per tenant, the models accepted instead of a requested one, and when.
- canaries: one per alias: candidate, share in basis points, guardrails, state and why it ended.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30 09:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RUN_COLUMNS = ("requested_model", "route_reason", "worker_pool", "quality_tier", "fallback_from", "route_detail")
USAGE_COLUMNS = ("route_reason", "worker_pool", "quality_tier")


def upgrade() -> None:
    for name in RUN_COLUMNS:
        op.add_column("runs", sa.Column(name, sa.Text(), nullable=True))
    op.create_check_constraint(
        "ck_runs_route_reason_known", "runs",
        "route_reason IS NULL OR route_reason IN ('requested', 'alias', 'canary', 'fallback')")
    for name in USAGE_COLUMNS:
        op.add_column("usage_entries", sa.Column(name, sa.Text(), nullable=True))

    op.create_table(
        "tenant_fallbacks",
        sa.Column("tenant_id", sa.UUID(), nullable=False),
        sa.Column("from_model", sa.Text(), nullable=False),
        sa.Column("to_model", sa.Text(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("conditions", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.CheckConstraint("from_model <> to_model", name=op.f("ck_tenant_fallbacks_not_itself")),
        sa.CheckConstraint("cardinality(conditions) > 0 AND conditions <@ ARRAY['backlog', 'deadline']::text[]",
                           name=op.f("ck_tenant_fallbacks_conditions_known")),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE",
                                name=op.f("fk_tenant_fallbacks_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("tenant_id", "from_model", "to_model", name=op.f("pk_tenant_fallbacks")),
    )
    op.create_table(
        "canaries",
        sa.Column("alias", sa.Text(), nullable=False),
        sa.Column("baseline_version", sa.Text(), nullable=False),
        sa.Column("candidate_version", sa.Text(), nullable=False),
        sa.Column("share_bp", sa.Integer(), nullable=False),
        sa.Column("state", sa.Text(), server_default="active", nullable=False),
        sa.Column("window_s", sa.Float(), nullable=False),
        sa.Column("min_samples", sa.Integer(), nullable=False),
        sa.Column("max_ttft_ratio", sa.Float(), nullable=False),
        sa.Column("max_tpot_ratio", sa.Float(), nullable=False),
        sa.Column("max_failure_rate_increase", sa.Float(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("last_judgment", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("judged_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("share_bp BETWEEN 0 AND 10000", name=op.f("ck_canaries_share_in_range")),
        sa.CheckConstraint("state IN ('active', 'rolled_back', 'promoted')", name=op.f("ck_canaries_state_known")),
        sa.CheckConstraint("baseline_version <> candidate_version", name=op.f("ck_canaries_two_versions")),
        sa.CheckConstraint("state = 'active' OR share_bp = 0", name=op.f("ck_canaries_ended_at_zero")),
        sa.ForeignKeyConstraint(["baseline_version"], ["models.version"],
                                name=op.f("fk_canaries_baseline_version_models")),
        sa.ForeignKeyConstraint(["candidate_version"], ["models.version"],
                                name=op.f("fk_canaries_candidate_version_models")),
        sa.PrimaryKeyConstraint("alias", name=op.f("pk_canaries")),
    )


def downgrade() -> None:
    op.drop_table("canaries")
    op.drop_table("tenant_fallbacks")
    for name in USAGE_COLUMNS:
        op.drop_column("usage_entries", name)
    op.drop_constraint("ck_runs_route_reason_known", "runs", type_="check")
    for name in RUN_COLUMNS:
        op.drop_column("runs", name)
