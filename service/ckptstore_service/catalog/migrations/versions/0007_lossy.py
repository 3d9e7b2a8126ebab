"""Lossy checkpoints (issue 23, docs/lossy.md): ``checkpoints.lossy_json`` (NULL: bit-exact;
else the JSON of the lossy parameters its paired fp32 tensors were stored with) and
``tensors.sent_checksum`` (the xxh3-128 of a tensor as it was sent, where it loads to other
bytes: what an idempotent retry of its save is compared with; NULL: ``checksum``).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("lossy_json", sa.Text(), nullable=True))
    op.add_column("tensors", sa.Column("sent_checksum", sa.LargeBinary(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tensors") as batch:
        batch.drop_column("sent_checksum")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("lossy_json")
