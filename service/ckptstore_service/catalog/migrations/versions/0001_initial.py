"""Initial schema: runs, checkpoints, tensors, chunks.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_COMMITTED = sa.text("status = 'committed'")


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("parent_id", sa.Integer(), sa.ForeignKey("checkpoints.id"), nullable=True),
        sa.Column("blob_key", sa.String(512), nullable=False),
        sa.Column("keyframe", sa.Boolean(), nullable=False),
        sa.Column("chain_depth", sa.Integer(), nullable=False),
        sa.Column("since_keyframe", sa.Integer(), nullable=False),
        sa.Column("raw_bytes", sa.BigInteger(), nullable=False),
        sa.Column("stored_bytes", sa.BigInteger(), nullable=False),
        sa.Column("n_tensors", sa.Integer(), nullable=False),
        sa.Column("metadata_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("committed_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index(
        "uq_checkpoints_run_step_committed",
        "checkpoints",
        ["run_id", "step"],
        unique=True,
        sqlite_where=_COMMITTED,
        postgresql_where=_COMMITTED,
    )
    op.create_index("ix_checkpoints_status", "checkpoints", ["status"])
    op.create_table(
        "tensors",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "checkpoint_id",
            sa.Integer(),
            sa.ForeignKey("checkpoints.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("shape", sa.Text(), nullable=False),
        sa.Column("begin", sa.BigInteger(), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("checksum", sa.LargeBinary(16), nullable=False),
    )
    op.create_index("ix_tensors_checkpoint", "tensors", ["checkpoint_id", "idx"], unique=True)
    op.create_table(
        "chunks",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "checkpoint_id",
            sa.Integer(),
            sa.ForeignKey("checkpoints.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("tensor_idx", sa.Integer(), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("raw_len", sa.BigInteger(), nullable=False),
        sa.Column("itemsize", sa.Integer(), nullable=False),
        sa.Column("codec", sa.String(64), nullable=False),
        sa.Column("base_id", sa.Integer(), sa.ForeignKey("chunks.id"), nullable=True),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("blob_offset", sa.BigInteger(), nullable=False),
        sa.Column("stored_len", sa.BigInteger(), nullable=False),
        sa.Column("checksum", sa.LargeBinary(16), nullable=False),
    )
    op.create_index("ix_chunks_checkpoint", "chunks", ["checkpoint_id", "tensor_idx", "offset"])
    op.create_index("ix_chunks_base", "chunks", ["base_id"])


def downgrade() -> None:
    op.drop_table("chunks")
    op.drop_table("tensors")
    op.drop_table("checkpoints")
    op.drop_table("runs")
