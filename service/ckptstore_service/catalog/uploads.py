"""The upload protocol: :func:`begin` (a ``writing`` row) -> :func:`commit` | :func:`abort`.

Call order, under the run's lock (:meth:`Catalog.run_lock`) for the whole upload (its lease
is the commit's ``fence``):

1. :func:`begin` records the upload before its first byte is written: the ``writing`` row
   names the blob, so a crash at any later point leaves bytes that the start-up collection
   finds (:func:`uploads_in_progress`). The row is invisible to every listing.
2. The caller writes the blob and waits until it is durable.
3. :func:`commit` makes the checkpoint visible in one transaction (rows of its tensors and
   chunks, the checkpoint's figures, ``committed``), or :func:`abort` drops the row once
   the blob is gone (never before: the row is what names the blob for collection).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ckptstore_core.errors import CheckpointExists
from ckptstore_service.catalog.db import Database, utc
from ckptstore_service.catalog.locks import Lease, check_fence
from ckptstore_service.catalog.models import (
    COMMITTED,
    WRITING,
    Base,
    Checkpoint,
    Chunk,
    Run,
    TensorRow,
)
from ckptstore_service.catalog.records import NewChunk, TensorInfo

__all__ = [
    "Figures",
    "abort",
    "begin",
    "commit",
    "insert_rows",
    "is_writing",
    "uploads_in_progress",
]

# Core tables rather than ORM entities: the ORM's bulk path costs ~5x the CPU per row, and a
# checkpoint has thousands of chunks.
_TENSORS = Base.metadata.tables[TensorRow.__tablename__]
_CHUNKS = Base.metadata.tables[Chunk.__tablename__]


@dataclass(frozen=True, slots=True)
class Figures:
    """What a commit records of the checkpoint itself (fields named as its columns)."""

    parent_id: int | None
    keyframe: bool
    chain_depth: int
    since_keyframe: int
    raw_bytes: int
    stored_bytes: int
    metadata: dict[str, str]
    lossy: Mapping[str, Any] | None = None  # the lossy parameters; None: bit-exact
    pairing: Mapping[str, Any] | None = None  # what a lossy save paired; None: not asked

    def columns(self) -> dict[str, object]:
        """The checkpoint row's columns, as these figures set them."""
        json_fields = ("metadata", "lossy", "pairing")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in json_fields}
        out["metadata_json"] = json.dumps(self.metadata)
        out["lossy_json"] = None if self.lossy is None else json.dumps(dict(self.lossy))
        out["pairing_json"] = None if self.pairing is None else json.dumps(dict(self.pairing))
        return out


def begin(db: Database, run_id: int, step: int, blob_key: str) -> int:
    """Record an upload in progress; its row names the blob for garbage collection."""
    with db.session() as s:
        return int(
            s.execute(
                insert(Checkpoint)
                .values(run_id=run_id, step=step, status=WRITING, blob_key=blob_key)
                .returning(Checkpoint.id)
            ).scalar_one()
        )


def commit(
    db: Database,
    checkpoint_id: int,
    figures: Figures,
    tensors: Sequence[TensorInfo],
    chunks: Sequence[NewChunk],
    sibling_bases: Mapping[int, int],
    fence: Lease | None = None,
) -> None:
    """Make the checkpoint visible: one transaction, after all its bytes are durable.

    ``fence`` is the run lock's lease: checked first in the transaction, which then holds
    the lock's row until it ends, so a writer whose lock was lost (and taken by another)
    gets LockLost and commits nothing (:func:`.locks.check_fence`).

    ``sibling_bases`` maps the position of a chunk in ``chunks`` to the position of its
    base when that base is a chunk of this same checkpoint (a bf16 copy predicted from its
    fp32 master): those get their ``base_id`` once the others have ids. Raises
    CheckpointExists, changing nothing, if the step was committed meanwhile.
    """
    try:
        with db.session() as s:
            if fence is not None:
                check_fence(s, fence)
            insert_rows(s, checkpoint_id, 0, tensors, chunks, sibling_bases)
            s.execute(
                update(Checkpoint)
                .where(Checkpoint.id == checkpoint_id)
                .values(
                    status=COMMITTED,
                    n_tensors=len(tensors),
                    committed_at=datetime.now(UTC),
                    **figures.columns(),
                )
            )
    except IntegrityError as exc:
        raise CheckpointExists(f"checkpoint {checkpoint_id} was committed concurrently") from exc


def insert_rows(
    s: Session,
    checkpoint_id: int,
    part_id: int,
    tensors: Sequence[TensorInfo],
    chunks: Sequence[NewChunk],
    sibling_bases: Mapping[int, int],
) -> None:
    """Insert the tensor and chunk rows of a checkpoint (or of its part ``part_id``; 0:
    none) in the transaction ``s``. ``sibling_bases`` as :func:`commit` takes it."""
    owner = {"checkpoint_id": checkpoint_id, "part_id": part_id}
    tensor_rows = [
        {
            **owner,
            "idx": t.idx,
            "name": t.name,
            "dtype": t.dtype,
            "shape": json.dumps(list(t.shape)),
            "begin": t.begin,
            "nbytes": t.nbytes,
            "checksum": t.checksum,
            "sent_checksum": t.sent_checksum,
        }
        for t in tensors
    ]
    if tensor_rows:
        s.execute(insert(_TENSORS), tensor_rows)
    chunk_rows = [{**owner, **{f: getattr(c, f) for f in NewChunk.__slots__}} for c in chunks]
    _insert_chunks(s, chunk_rows, dict(sibling_bases))


def _insert_chunks(s: Session, rows: list[dict[str, Any]], siblings: dict[int, int]) -> None:
    """Insert the chunk rows; those in ``siblings`` after the others, once their bases'
    ids are known."""
    first = [i for i in range(len(rows)) if i not in siblings]
    if not first:
        return
    if not siblings:
        s.execute(insert(_CHUNKS), rows)
        return
    ids = s.scalars(
        insert(_CHUNKS).returning(_CHUNKS.c.id, sort_by_parameter_order=True),
        [rows[i] for i in first],
    ).all()
    id_of = dict(zip(first, ids, strict=True))
    for i, base in siblings.items():
        rows[i]["base_id"] = id_of[base]
    s.execute(insert(_CHUNKS), [rows[i] for i in siblings])


def abort(db: Database, checkpoint_id: int) -> None:
    """Drop an upload's ``writing`` row (a committed one stays): only once its blob is gone."""
    with db.session() as s:
        s.execute(
            delete(Checkpoint).where(Checkpoint.id == checkpoint_id, Checkpoint.status == WRITING)
        )


def is_writing(db: Database, checkpoint_id: int) -> bool:
    """Whether row ``checkpoint_id`` is still an upload's ``writing`` row (not committed
    since, nor gone)."""
    query = select(Checkpoint.id).where(
        Checkpoint.id == checkpoint_id, Checkpoint.status == WRITING
    )
    with db.session() as s:
        return s.execute(query).first() is not None


def uploads_in_progress(db: Database) -> list[tuple[int, str, str, datetime]]:
    """``(checkpoint_id, run, blob_key, created_at)`` of every ``writing`` row."""
    query = (
        select(Checkpoint.id, Run.name, Checkpoint.blob_key, Checkpoint.created_at)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Checkpoint.status == WRITING)
    )
    with db.session() as s:
        return [(i, r, k, utc(c)) for i, r, k, c in s.execute(query).all()]
