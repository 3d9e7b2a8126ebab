"""Checkpoints whose writers encoded their own chunks (issue 28, docs/scale.md):
``parts.encoded_by`` (``service`` or ``client``) and ``checkpoints.verification``
(``service``: encoded by the service; ``pending``, ``verified`` or ``corrupt``: holds chunks
a writer encoded, and how far the background verifier got with them).

Revision ID: 0012
Revises: 0009
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "parts", sa.Column("encoded_by", sa.String(16), nullable=False, server_default="service")
    )
    op.add_column(
        "checkpoints",
        sa.Column("verification", sa.String(16), nullable=False, server_default="service"),
    )


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("verification")
    with op.batch_alter_table("parts") as batch:
        batch.drop_column("encoded_by")
