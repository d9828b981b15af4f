"""A run's prompt token ids as bytes: 4-byte big-endian integers back to back (ledger/token_ids.py).

asyncpg encodes an int4[] parameter element by element with Python-level checks (~0.6 ms of the
gateway's CPU for a 2,000-token prompt, seed 002's) and PostgreSQL parses each element again; bytes
cross both as one copy. Existing rows are converted with int4send (the same byte order), and back on
downgrade.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02 15:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0014'
down_revision: str | None = '0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# ALTER COLUMN ... USING takes no subquery: each direction is a function of the session's own schema.
TO_BYTES = """
CREATE FUNCTION pg_temp.sluice_token_ids_to_bytes(ids int4[]) RETURNS bytea LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(string_agg(int4send(id), ''::bytea ORDER BY position), ''::bytea)
      FROM unnest(ids) WITH ORDINALITY AS token(id, position)
$$"""
TO_ARRAY = """
CREATE FUNCTION pg_temp.sluice_token_ids_to_array(stored bytea) RETURNS int4[] LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(array_agg((get_byte(stored, at) << 24) | (get_byte(stored, at + 1) << 16)
                              | (get_byte(stored, at + 2) << 8) | get_byte(stored, at + 3) ORDER BY at),
                    '{}'::int4[])
      FROM generate_series(0, length(stored) - 4, 4) AS at
$$"""


def upgrade() -> None:
    op.execute(TO_BYTES)
    op.execute("ALTER TABLE runs ALTER COLUMN prompt_token_ids TYPE bytea"
               " USING pg_temp.sluice_token_ids_to_bytes(prompt_token_ids)")


def downgrade() -> None:
    op.execute(TO_ARRAY)
    op.execute("ALTER TABLE runs ALTER COLUMN prompt_token_ids TYPE int4[]"
               " USING pg_temp.sluice_token_ids_to_array(prompt_token_ids)")
