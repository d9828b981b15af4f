"""Admin and finance: key scopes and salted hashes, suspension, versioned price cards, the key and
price card on runs and usage entries, the admin audit table, the durable replica registry.

- api_keys: scope (tenant | finance | admin; tenant_id NULL only for the other two), per-key salt,
  label, expiry, last use, the key it was rotated from. Existing keys keep their unsalted hash.
- price_cards: one row per price version; every existing model gets its current prices as its
  first card, and its runs and usage entries are pinned to it.
- budgets: the two CHECKs `reserved + used <= budget` become one trigger that checks only when a
  reservation grows. An operator may then lower a budget below what runs in flight hold: new
  work is refused (the reservation would grow) while those runs still settle (it shrinks).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 06:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TOKENS_WITHIN_BUDGET = 'reserved_tokens + used_tokens <= token_budget'
COST_WITHIN_BUDGET = 'reserved_cost_micros + used_cost_micros <= cost_budget_micros'

# Raises with the names of the CHECKs it replaces, so the refusal reads the same as before.
RESERVATION_FITS = """
CREATE FUNCTION budgets_reservation_fits() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'UPDATE' AND NEW.reserved_tokens <= OLD.reserved_tokens
     AND NEW.reserved_cost_micros <= OLD.reserved_cost_micros THEN
    RETURN NEW;
  END IF;
  IF NEW.reserved_tokens + NEW.used_tokens > NEW.token_budget THEN
    RAISE EXCEPTION 'budget row violates ck_budgets_tokens_within_budget: a reservation may not grow past token_budget'
      USING ERRCODE = 'check_violation', CONSTRAINT = 'ck_budgets_tokens_within_budget';
  END IF;
  IF NEW.reserved_cost_micros + NEW.used_cost_micros > NEW.cost_budget_micros THEN
    RAISE EXCEPTION 'budget row violates ck_budgets_cost_within_budget: a reservation may not grow past cost_budget_micros'
      USING ERRCODE = 'check_violation', CONSTRAINT = 'ck_budgets_cost_within_budget';
  END IF;
  RETURN NEW;
END $$
"""
RESERVATION_FITS_TRIGGER = """
CREATE TRIGGER budgets_reservation_fits BEFORE INSERT OR UPDATE ON budgets
  FOR EACH ROW EXECUTE FUNCTION budgets_reservation_fits()
"""


def upgrade() -> None:
    op.add_column('tenants', sa.Column('suspended_at', sa.DateTime(timezone=True), nullable=True))

    op.alter_column('api_keys', 'tenant_id', existing_type=sa.UUID(), nullable=True)
    op.add_column('api_keys', sa.Column('key_salt', sa.Text(), nullable=True))
    op.add_column('api_keys', sa.Column('scope', sa.Text(), server_default='tenant', nullable=False))
    op.add_column('api_keys', sa.Column('label', sa.Text(), server_default='', nullable=False))
    op.add_column('api_keys', sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('api_keys', sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('api_keys', sa.Column('rotated_from', sa.UUID(), nullable=True))
    op.create_index(op.f('ix_api_keys_key_prefix'), 'api_keys', ['key_prefix'], unique=False)
    op.create_check_constraint(op.f('ck_api_keys_scope_known'), 'api_keys',
                               "scope IN ('tenant', 'finance', 'admin')")
    op.create_check_constraint(op.f('ck_api_keys_tenant_key_has_tenant'), 'api_keys',
                               "scope <> 'tenant' OR tenant_id IS NOT NULL")

    op.create_table(
        'price_cards',
        sa.Column('id', sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column('model_version', sa.Text(), nullable=False),
        sa.Column('price_input_per_m_micros', sa.BigInteger(), nullable=False),
        sa.Column('price_cached_input_per_m_micros', sa.BigInteger(), nullable=False),
        sa.Column('price_output_per_m_micros', sa.BigInteger(), nullable=False),
        sa.Column('effective_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.CheckConstraint('price_input_per_m_micros >= 0 AND price_cached_input_per_m_micros >= 0'
                           ' AND price_output_per_m_micros >= 0',
                           name=op.f('ck_price_cards_prices_non_negative')),
        sa.ForeignKeyConstraint(['model_version'], ['models.version'],
                                name=op.f('fk_price_cards_model_version_models')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_price_cards')),
    )
    op.create_index(op.f('ix_price_cards_model_version'), 'price_cards', ['model_version'], unique=False)

    op.add_column('models', sa.Column('price_card_id', sa.BigInteger(), nullable=True))
    op.add_column('models', sa.Column('retired_at', sa.DateTime(timezone=True), nullable=True))
    op.create_foreign_key(op.f('fk_models_price_card_id_price_cards'), 'models', 'price_cards',
                          ['price_card_id'], ['id'])

    op.add_column('runs', sa.Column('api_key_id', sa.UUID(), nullable=True))
    op.add_column('runs', sa.Column('price_card_id', sa.BigInteger(), nullable=True))
    op.create_foreign_key(op.f('fk_runs_price_card_id_price_cards'), 'runs', 'price_cards',
                          ['price_card_id'], ['id'])
    op.add_column('usage_entries', sa.Column('api_key_id', sa.UUID(), nullable=True))
    op.add_column('usage_entries', sa.Column('price_card_id', sa.BigInteger(), nullable=True))
    op.create_foreign_key(op.f('fk_usage_entries_price_card_id_price_cards'), 'usage_entries', 'price_cards',
                          ['price_card_id'], ['id'])
    op.create_index('ix_usage_entries_settled_at', 'usage_entries', ['settled_at'], unique=False)

    # Every existing model's current prices become its first card; its runs are pinned to it.
    op.execute("""
        INSERT INTO price_cards (model_version, price_input_per_m_micros, price_cached_input_per_m_micros,
                                 price_output_per_m_micros)
        SELECT version, price_input_per_m_micros, price_cached_input_per_m_micros, price_output_per_m_micros
        FROM models
    """)
    op.execute("UPDATE models m SET price_card_id = c.id FROM price_cards c WHERE c.model_version = m.version")
    op.execute("UPDATE runs r SET price_card_id = m.price_card_id FROM models m WHERE m.version = r.model_version")
    op.execute("UPDATE usage_entries u SET price_card_id = r.price_card_id FROM runs r WHERE r.id = u.run_id")

    op.drop_constraint(op.f('ck_budgets_tokens_within_budget'), 'budgets', type_='check')
    op.drop_constraint(op.f('ck_budgets_cost_within_budget'), 'budgets', type_='check')
    op.execute(RESERVATION_FITS)
    op.execute(RESERVATION_FITS_TRIGGER)

    op.create_table(
        'admin_audit',
        sa.Column('id', sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('actor_key_id', sa.UUID(), nullable=True),
        sa.Column('actor_key_prefix', sa.Text(), nullable=False),
        sa.Column('action', sa.Text(), nullable=False),
        sa.Column('target', sa.Text(), nullable=False),
        sa.Column('before', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column('after', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_admin_audit')),
    )

    op.execute("CREATE SEQUENCE replicas_revision_seq")
    op.create_table(
        'replicas',
        sa.Column('name', sa.Text(), nullable=False),
        sa.Column('pool', sa.Text(), server_default='', nullable=False),
        sa.Column('grpc_address', sa.Text(), server_default='', nullable=False),
        sa.Column('metrics_url', sa.Text(), server_default='', nullable=False),
        sa.Column('block_size', sa.Integer(), nullable=False),
        sa.Column('kv_capacity_blocks', sa.BigInteger(), nullable=False),
        sa.Column('long_context', sa.Boolean(), server_default=sa.text('false'), nullable=False),
        sa.Column('removed', sa.Boolean(), server_default=sa.text('false'), nullable=False),
        sa.Column('revision', sa.BigInteger(), server_default=sa.text("nextval('replicas_revision_seq')"),
                  nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.PrimaryKeyConstraint('name', name=op.f('pk_replicas')),
    )
    op.create_index(op.f('ix_replicas_revision'), 'replicas', ['revision'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_replicas_revision'), table_name='replicas')
    op.drop_table('replicas')
    op.execute("DROP SEQUENCE replicas_revision_seq")
    op.drop_table('admin_audit')

    op.execute("DROP TRIGGER budgets_reservation_fits ON budgets")
    op.execute("DROP FUNCTION budgets_reservation_fits()")
    op.create_check_constraint(op.f('ck_budgets_cost_within_budget'), 'budgets', COST_WITHIN_BUDGET)
    op.create_check_constraint(op.f('ck_budgets_tokens_within_budget'), 'budgets', TOKENS_WITHIN_BUDGET)

    op.drop_index('ix_usage_entries_settled_at', table_name='usage_entries')
    op.drop_constraint(op.f('fk_usage_entries_price_card_id_price_cards'), 'usage_entries', type_='foreignkey')
    op.drop_column('usage_entries', 'price_card_id')
    op.drop_column('usage_entries', 'api_key_id')
    op.drop_constraint(op.f('fk_runs_price_card_id_price_cards'), 'runs', type_='foreignkey')
    op.drop_column('runs', 'price_card_id')
    op.drop_column('runs', 'api_key_id')
    op.drop_constraint(op.f('fk_models_price_card_id_price_cards'), 'models', type_='foreignkey')
    op.drop_column('models', 'retired_at')
    op.drop_column('models', 'price_card_id')
    op.drop_index(op.f('ix_price_cards_model_version'), table_name='price_cards')
    op.drop_table('price_cards')

    op.drop_constraint(op.f('ck_api_keys_tenant_key_has_tenant'), 'api_keys', type_='check')
    op.drop_constraint(op.f('ck_api_keys_scope_known'), 'api_keys', type_='check')
    op.drop_index(op.f('ix_api_keys_key_prefix'), table_name='api_keys')
    # Keys of other scopes have no tenant and cannot survive the NOT NULL that comes back.
    op.execute("DELETE FROM api_keys WHERE tenant_id IS NULL")
    for column in ('rotated_from', 'last_used_at', 'expires_at', 'label', 'scope', 'key_salt'):
        op.drop_column('api_keys', column)
    op.alter_column('api_keys', 'tenant_id', existing_type=sa.UUID(), nullable=False)
    op.drop_column('tenants', 'suspended_at')
