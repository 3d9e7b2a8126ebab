"""SQLAlchemy 2.0 models of the catalog: runs, checkpoints, tensors, chunks, garbage.

A checkpoint row is inserted as ``writing`` before its bytes are uploaded (so a crashed upload
leaves a row that names its orphaned blob) and flipped to ``committed`` in the same transaction
that inserts its tensors and chunks. Only committed rows are ever visible through the API. The
``(run_id, step)`` uniqueness holds among committed rows only, so a retry can start while a
dead upload's ``writing`` row still waits for garbage collection.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "Base",
    "Checkpoint",
    "Chunk",
    "Garbage",
    "Part",
    "Run",
    "RunLockRow",
    "TensorRow",
    "Token",
]

WRITING = "writing"
COMMITTED = "committed"
PARTS = "parts"  # a checkpoint of several parts, not committed yet (see Part)
DONE = "done"  # a part whose blob is durable and whose rows are in
# who encoded a part's chunks (parts.encoded_by), and how far a checkpoint's are checked
# (checkpoints.verification): docs/scale.md
SERVICE = "service"  # encoded by the service, checked as it encoded them
CLIENT = "client"  # encoded by its writer (direct=True)
PENDING = "pending"  # holds client-encoded chunks the verifier has not decoded yet
VERIFIED = "verified"  # the verifier decoded every chunk to its raw checksum
CORRUPT = "corrupt"  # the verifier found a chunk that does not decode to its checksum
# A deleted checkpoint's row stays, without tensors, chunks, parts or blob, invisible like an
# upload in progress: its id is never given again (SQLite reuses the largest rowid once its
# row is gone), so nothing keyed by a checkpoint id, such as a replica's base-cache file,
# can be taken for a later checkpoint's (see ckptstore_service.catalog.lifecycle).
DELETED = "deleted"


def _now() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)
    # the run's retention policy (ckptstore_core.retention.RetentionPolicy as JSON); None:
    # none of its own, the service's default applies
    retention_json: Mapped[str | None] = mapped_column(Text, nullable=True)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        Index(
            "uq_checkpoints_run_step_committed",
            "run_id",
            "step",
            unique=True,
            sqlite_where=text("status = 'committed'"),
            postgresql_where=text("status = 'committed'"),
        ),
        Index("ix_checkpoints_status", "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16), default=WRITING)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"), nullable=True)
    blob_key: Mapped[str] = mapped_column(String(512))
    keyframe: Mapped[bool] = mapped_column(Boolean, default=False)
    chain_depth: Mapped[int] = mapped_column(Integer, default=0)
    since_keyframe: Mapped[int] = mapped_column(Integer, default=0)
    raw_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    n_tensors: Mapped[int] = mapped_column(Integer, default=0)
    metadata_json: Mapped[str] = mapped_column(Text, default="{}")
    n_parts: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # never deleted while set: not by retention, not by hand (unpin first)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # NULL: bit-exact; else the JSON of the lossy parameters its paired tensors were stored
    # with (ckptstore_core.lossy.Lossy.to_json(), docs/lossy.md)
    lossy_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    # SERVICE, PENDING, VERIFIED or CORRUPT (see above)
    verification: Mapped[str] = mapped_column(String(16), default=SERVICE, server_default=SERVICE)
    # NULL: not asked to be lossy; else the JSON of what its lossy save or archival paired
    # (ckptstore_core.lossy.Pairing.summary(), docs/lossy.md#which-weights-pair)
    pairing_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)
    committed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Part(Base):
    """One writer's part of a checkpoint written by several (the ranks of a distributed
    save), with a blob of its own. Its tensor and chunk rows carry its id (``part_id``) and
    number their tensors from 0 until the checkpoint's commit renumbers them into one
    sequence; until then the checkpoint's row stays ``parts``, invisible. A ``writing``
    part's upload is in progress (or crashed: its blob is collected)."""

    __tablename__ = "parts"
    __table_args__ = (Index("uq_parts_checkpoint_name", "checkpoint_id", "name", unique=True),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    blob_key: Mapped[str] = mapped_column(String(512))
    status: Mapped[str] = mapped_column(String(16), default=WRITING)
    raw_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    n_tensors: Mapped[int] = mapped_column(Integer, default=0)
    encoded_by: Mapped[str] = mapped_column(String(16), default=SERVICE, server_default=SERVICE)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


class TensorRow(Base):
    __tablename__ = "tensors"
    __table_args__ = (
        Index("ix_tensors_checkpoint", "checkpoint_id", "part_id", "idx", unique=True),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    part_id: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # 0: none
    idx: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(Text)
    dtype: Mapped[str] = mapped_column(String(16))
    shape: Mapped[str] = mapped_column(Text)  # JSON list
    begin: Mapped[int] = mapped_column(BigInteger)  # offset in the data section
    nbytes: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[bytes] = mapped_column(LargeBinary(16))  # xxh3-128 of the whole tensor
    # xxh3-128 of the tensor as it was sent, where that is not what it loads to (a lossy
    # tensor: ``checksum`` is its reconstruction's); NULL: ``checksum``. What an idempotent
    # retry of the save is compared with.
    sent_checksum: Mapped[bytes | None] = mapped_column(LargeBinary(16), nullable=True)


class Chunk(Base):
    __tablename__ = "chunks"
    __table_args__ = (
        Index("ix_chunks_checkpoint", "checkpoint_id", "tensor_idx", "offset"),
        Index("ix_chunks_base", "base_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    # the part whose blob holds it (0: the checkpoint's own blob)
    part_id: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    tensor_idx: Mapped[int] = mapped_column(Integer)
    offset: Mapped[int] = mapped_column(BigInteger)  # within the tensor
    raw_len: Mapped[int] = mapped_column(BigInteger)
    itemsize: Mapped[int] = mapped_column(Integer)
    codec: Mapped[str] = mapped_column(String(64))
    # The chunk this one is a delta of (or, for "ref", equal to); never itself a ref.
    base_id: Mapped[int | None] = mapped_column(ForeignKey("chunks.id"), nullable=True)
    depth: Mapped[int] = mapped_column(Integer, default=0)  # deltas to decode, 0 = self-contained
    blob_offset: Mapped[int] = mapped_column(BigInteger)
    stored_len: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[bytes] = mapped_column(LargeBinary(16))  # xxh3-128 of the raw bytes


class Garbage(Base):
    """A blob to delete once ``not_before`` has passed (and its run's re-root lock is free;
    see ``ckptstore_service.maintenance.collect_garbage``)."""

    __tablename__ = "garbage"
    __table_args__ = (Index("ix_garbage_not_before", "not_before"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    blob_key: Mapped[str] = mapped_column(String(512))
    not_before: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Token(Base):
    """A bearer token (:mod:`ckptstore_service.auth`): only the SHA-256 of its secret is
    stored. A revoked token keeps its row (``revoked_at`` set) for the listing; a name is
    unique among the tokens not revoked."""

    __tablename__ = "tokens"
    __table_args__ = (
        Index("uq_tokens_secret_hash", "secret_hash", unique=True),
        Index(
            "uq_tokens_name_active",
            "name",
            unique=True,
            sqlite_where=text("revoked_at IS NULL"),
            postgresql_where=text("revoked_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    secret_hash: Mapped[str] = mapped_column(String(64))  # sha256 hex of the whole token
    scope: Mapped[str] = mapped_column(String(16))  # read | write | admin
    runs: Mapped[str | None] = mapped_column(String(1024), nullable=True)  # None: every run
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class RunLockRow(Base):
    """A lock held (:mod:`ckptstore_service.catalog.locks`): one row while it is held, gone
    once released. ``token`` is the fencing token of this holding (random, never reused in
    practice), which the commit that the lock guards checks in its own transaction;
    ``expires_at`` (PostgreSQL's leases) is when another holder may take it over unless
    ``holder`` renews it first; NULL where the lock is an flock or a thread lock."""

    __tablename__ = "run_locks"
    __table_args__ = (Index("ix_run_locks_holder", "holder"),)

    purpose: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(Text, primary_key=True)
    token: Mapped[int] = mapped_column(BigInteger)
    holder: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
