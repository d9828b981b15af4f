"""A run's prompt token ids compressed with lz4 instead of pglz.

A 2,000-token prompt (seed 002's) is ~7.7 KB of ids, above PostgreSQL's 2 KB TOAST threshold, so
every Submit's INSERT compresses it before moving it out of line. `python -m
bench.bench_prompt_storage` (1,000 rows of corpus prompts, backend CPU per row): insert 290 us with
pglz, 130 with lz4, 100 uncompressed; read back 70-90 us each; stored in 4.5, 5.7 and 8.8 KB. A
server built without lz4 stores the column uncompressed instead (STORAGE EXTERNAL). Existing rows
keep the compression they were written with.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02 17:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0015'
down_revision: str | None = '0014'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UPGRADE = """
DO $$
BEGIN
    ALTER TABLE runs ALTER COLUMN prompt_token_ids SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    ALTER TABLE runs ALTER COLUMN prompt_token_ids SET STORAGE EXTERNAL;
END $$"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute("ALTER TABLE runs ALTER COLUMN prompt_token_ids SET COMPRESSION default")
    op.execute("ALTER TABLE runs ALTER COLUMN prompt_token_ids SET STORAGE EXTENDED")
