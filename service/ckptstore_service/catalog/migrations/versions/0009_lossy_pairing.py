"""What a lossy save paired (issue 30, docs/lossy.md#which-weights-pair):
``checkpoints.pairing_json`` (NULL: not asked to be lossy; else the JSON of
``ckptstore_core.lossy.Pairing.summary()``: how many fp32 weights, and their bytes, were
paired with their Adam moments, paired without, and left exact, and the state's layout).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("pairing_json", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("pairing_json")
