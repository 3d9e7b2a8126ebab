"""Blobs waiting to be deleted: the ones a re-rooted chain no longer uses (kept a grace time
for loads still reading them) and the ones a re-root is writing (named before they exist, so
a crash leaves no blob that nothing names).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "garbage",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("blob_key", sa.String(512), nullable=False),
        sa.Column("not_before", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_garbage_not_before", "garbage", ["not_before"])


def downgrade() -> None:
    op.drop_table("garbage")
