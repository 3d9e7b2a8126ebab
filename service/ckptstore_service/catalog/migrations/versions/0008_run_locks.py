"""Run locks as rows: ``run_locks`` holds one row per lock held, with its fencing token, its
holder and (PostgreSQL) when its lease expires unless renewed
(:mod:`ckptstore_service.catalog.locks`).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_locks",
        sa.Column("purpose", sa.String(16), primary_key=True),
        sa.Column("name", sa.Text(), primary_key=True),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.String(64), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_run_locks_holder", "run_locks", ["holder"])


def downgrade() -> None:
    op.drop_table("run_locks")
