"""Pins and retention policies: ``checkpoints.pinned`` (a pinned checkpoint is never deleted,
by retention or by hand) and ``runs.retention_json`` (the run's retention policy as JSON;
NULL: none of its own, the service's default applies).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "checkpoints",
        sa.Column("pinned", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.add_column("runs", sa.Column("retention_json", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("retention_json")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("pinned")
