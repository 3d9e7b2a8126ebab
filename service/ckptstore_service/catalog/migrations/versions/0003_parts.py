"""Checkpoints written in parts (the ranks of a distributed save): a ``parts`` table, the
part that holds each tensor and chunk row, and the number of parts per checkpoint.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "parts",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "checkpoint_id",
            sa.Integer(),
            sa.ForeignKey("checkpoints.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("blob_key", sa.String(512), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("raw_bytes", sa.BigInteger(), nullable=False),
        sa.Column("stored_bytes", sa.BigInteger(), nullable=False),
        sa.Column("n_tensors", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("uq_parts_checkpoint_name", "parts", ["checkpoint_id", "name"], unique=True)
    op.add_column(
        "checkpoints", sa.Column("n_parts", sa.Integer(), nullable=False, server_default="1")
    )
    for table in ("tensors", "chunks"):
        op.add_column(table, sa.Column("part_id", sa.Integer(), nullable=False, server_default="0"))
    op.drop_index("ix_tensors_checkpoint", "tensors")
    op.create_index(
        "ix_tensors_checkpoint", "tensors", ["checkpoint_id", "part_id", "idx"], unique=True
    )


def downgrade() -> None:
    op.drop_index("ix_tensors_checkpoint", "tensors")
    op.create_index("ix_tensors_checkpoint", "tensors", ["checkpoint_id", "idx"], unique=True)
    with op.batch_alter_table("chunks") as batch:
        batch.drop_column("part_id")
    with op.batch_alter_table("tensors") as batch:
        batch.drop_column("part_id")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("n_parts")
    op.drop_table("parts")
