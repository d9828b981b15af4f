"""Model registry: a chat template per model version.

The HTTP edge renders OpenAI-style `messages` into the one prompt string admission tokenizes, with
the template of the model version the request names (Jinja, the format Hugging Face tokenizers
ship theirs in). NULL = the model takes plain completions only (chat requests get a 400 naming
the model). Nullable, so existing rows keep working unchanged; `make seed` fills tiny-chat's.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 06:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('models', sa.Column('chat_template', sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column('models', 'chat_template')
