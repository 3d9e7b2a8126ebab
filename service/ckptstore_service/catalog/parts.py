"""Checkpoints written in parts: many writers (the ranks of a distributed save), one commit.

Call order:

1. :func:`open_checkpoint` (under the run's lock, briefly): the checkpoint's ``parts`` row,
   made by the first part to arrive; invisible to every listing, as ``latest`` and as a
   parent.
2. Per part, concurrently, through any replica, each under its own part lock:
   :func:`begin_part` (a ``writing`` part row that names the part's blob, before its first
   byte), the blob written and made durable, then :func:`finish_part` (one transaction: the
   part's tensor and chunk rows, numbered from 0 within the part, and the part ``done``) or
   :func:`drop_part` once its blob is gone.
3. :func:`commit_parts` (under the run's lock): one transaction renumbers the parts' tensors
   into one sequence (in the order the commit lists the parts: tensor indices and data
   offsets follow on from the previous part's), fills in the checkpoint's figures and makes
   it ``committed``: then, and only then, it is visible and ``latest`` moves.

Crashes: a ``writing`` part whose lock is free has no writer (its blob is an orphan); a
``parts`` checkpoint never committed is abandoned after a TTL (:func:`abandoned`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import case, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ckptstore_core.errors import CheckpointExists, InvalidRequest
from ckptstore_service.catalog.db import Database, utc
from ckptstore_service.catalog.graph import tensors
from ckptstore_service.catalog.locks import Lease, check_fence
from ckptstore_service.catalog.models import (
    CLIENT,
    COMMITTED,
    DONE,
    PARTS,
    PENDING,
    SERVICE,
    WRITING,
    Base,
    Checkpoint,
    Chunk,
    Part,
    Run,
    TensorRow,
)
from ckptstore_service.catalog.records import NewChunk, TensorInfo
from ckptstore_service.catalog.uploads import insert_rows

__all__ = [
    "PartRecord",
    "abandoned",
    "begin_part",
    "claim_part",
    "commit_parts",
    "committed_parts",
    "drop_checkpoint",
    "drop_part",
    "finish_part",
    "find_part",
    "open_checkpoint",
    "part_tensors",
    "parts_in_progress",
]

_TENSORS = Base.metadata.tables[TensorRow.__tablename__]
_CHUNKS = Base.metadata.tables[Chunk.__tablename__]


@dataclass(frozen=True, slots=True)
class PartRecord:
    id: int
    checkpoint_id: int
    name: str
    blob_key: str
    status: str  # WRITING or DONE
    raw_bytes: int
    stored_bytes: int
    n_tensors: int


def _part(row: Part) -> PartRecord:
    return PartRecord(
        row.id,
        row.checkpoint_id,
        row.name,
        row.blob_key,
        row.status,
        row.raw_bytes,
        row.stored_bytes,
        row.n_tensors,
    )


def open_checkpoint(db: Database, run_id: int, step: int) -> int:
    """The id of the ``parts`` row of ``run/step``, made if there is none; CheckpointExists
    if that step is committed already. The caller holds the run's lock."""
    with db.session() as s:
        rows = s.execute(
            select(Checkpoint.id, Checkpoint.status).where(
                Checkpoint.run_id == run_id,
                Checkpoint.step == step,
                Checkpoint.status.in_([PARTS, COMMITTED]),
            )
        ).all()
        for checkpoint_id, status in rows:
            if status == COMMITTED:
                raise CheckpointExists(f"step {step} is committed already")
            return int(checkpoint_id)
        return int(
            s.execute(
                insert(Checkpoint)
                .values(run_id=run_id, step=step, status=PARTS, blob_key="", n_parts=0)
                .returning(Checkpoint.id)
            ).scalar_one()
        )


def open_checkpoint_of(db: Database, run: str, step: int) -> int | None:
    """The id of the ``parts`` row of ``run/step``, if parts of it were uploaded and it is
    not committed yet."""
    with db.session() as s:
        found = s.scalar(
            select(Checkpoint.id)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(Run.name == run, Checkpoint.step == step, Checkpoint.status == PARTS)
        )
        return None if found is None else int(found)


def find_part(db: Database, checkpoint_id: int, name: str) -> PartRecord | None:
    with db.session() as s:
        row = s.scalar(select(Part).where(Part.checkpoint_id == checkpoint_id, Part.name == name))
        return None if row is None else _part(row)


def begin_part(db: Database, checkpoint_id: int, name: str, blob_key: str) -> int:
    """Record a part's upload before its first byte: the row names its blob."""
    with db.session() as s:
        return int(
            s.execute(
                insert(Part)
                .values(
                    checkpoint_id=checkpoint_id,
                    name=name,
                    blob_key=blob_key,
                    status=WRITING,
                    raw_bytes=0,
                    stored_bytes=0,
                    n_tensors=0,
                )
                .returning(Part.id)
            ).scalar_one()
        )


def finish_part(
    db: Database,
    part: PartRecord,
    *,
    raw_bytes: int,
    stored_bytes: int,
    tensors: Sequence[TensorInfo],
    chunks: Sequence[NewChunk],
    sibling_bases: dict[int, int],
    fence: Lease | None = None,
    encoded_by: str = SERVICE,
) -> None:
    """The part's rows and ``done``, in one transaction, once its blob is durable.
    ``fence``: the part lock's lease, checked first (LockLost, changing nothing);
    ``encoded_by``: CLIENT for chunks its writer encoded (the commit marks the checkpoint
    PENDING for the verifier).

    CheckpointExists, changing nothing, if the checkpoint was committed (without this part)
    or abandoned meanwhile: its rows must not join a checkpoint that is visible. The part's
    row is written first (SQLite: the write lock from the start) and the checkpoint's row is
    read FOR SHARE (PostgreSQL: a commit's update of it waits for this transaction).
    """
    with db.session() as s:
        if fence is not None:
            check_fence(s, fence)
        done = s.execute(
            update(Part)
            .where(Part.id == part.id, Part.status == WRITING)
            .values(
                status=DONE,
                raw_bytes=raw_bytes,
                stored_bytes=stored_bytes,
                n_tensors=len(tensors),
                encoded_by=encoded_by,
            )
            .returning(Part.id)
        ).first()
        status = s.scalar(
            select(Checkpoint.status)
            .where(Checkpoint.id == part.checkpoint_id)
            .with_for_update(read=True)
        )
        if done is None or status != PARTS:
            raise CheckpointExists(f"part {part.name!r}: its checkpoint is no longer open")
        insert_rows(s, part.checkpoint_id, part.id, tensors, chunks, sibling_bases)


def part_tensors(db: Database, part: PartRecord) -> list[TensorInfo]:
    """A finished part's tensors, numbered within the part (before the commit)."""
    return tensors(db, part.checkpoint_id, part_id=part.id)


def drop_part(db: Database, part_id: int) -> None:
    """Forget a part (once its blob is gone): its row, and its tensor and chunk rows."""
    with db.session() as s:
        s.execute(delete(_CHUNKS).where(_CHUNKS.c.part_id == part_id))
        s.execute(delete(_TENSORS).where(_TENSORS.c.part_id == part_id))
        s.execute(delete(Part).where(Part.id == part_id))


def claim_part(db: Database, part_id: int, abandoned_before: datetime | None = None) -> bool:
    """Whether the sweep may collect part ``part_id``, looked at again now (it was listed
    earlier); the caller holds the part's lock, so no upload changes the part meanwhile.

    A ``writing`` part may go: it has no writer. With ``abandoned_before``, so may any part
    of a checkpoint still uncommitted that began before then: the part is made ``writing``
    again in the same transaction, so no commit takes it any more (one that comes later
    finds it unfinished, then missing). False, changing nothing, for a part gone, finished
    meanwhile (without ``abandoned_before``), or of a checkpoint committed meanwhile.

    The part's row is written first (SQLite: the write lock from the start) and the
    checkpoint's row is read FOR SHARE (PostgreSQL: a commit holding it FOR UPDATE ends
    first, and none begins before this transaction ends).
    """
    with db.session() as s:
        touched = s.execute(
            update(Part)
            .where(Part.id == part_id)
            .values(status=Part.status)
            .returning(Part.status, Part.checkpoint_id)
        ).first()
        if touched is None:
            return False
        status, checkpoint_id = touched
        if abandoned_before is None:
            return bool(status == WRITING)
        checkpoint = s.execute(
            select(Checkpoint.status, Checkpoint.created_at)
            .where(Checkpoint.id == checkpoint_id)
            .with_for_update(read=True)
        ).first()
        if checkpoint is None or checkpoint.status != PARTS:
            return False
        if utc(checkpoint.created_at) >= abandoned_before:
            return False
        s.execute(update(Part).where(Part.id == part_id).values(status=WRITING))
        return True


def drop_checkpoint(db: Database, checkpoint_id: int) -> None:
    """Forget an abandoned ``parts`` checkpoint, if it has no parts left (an upload may have
    begun one since it was found abandoned)."""
    with db.session() as s:
        s.execute(
            delete(Checkpoint).where(
                Checkpoint.id == checkpoint_id,
                Checkpoint.status == PARTS,
                ~select(Part.id).where(Part.checkpoint_id == checkpoint_id).exists(),
            )
        )


def _check_parts(
    found: dict[str, PartRecord], names: Sequence[str], run: str, step: int
) -> list[PartRecord]:
    if not names:
        raise InvalidRequest("a commit names at least one part")
    if len(set(names)) != len(names):
        raise InvalidRequest("a commit names each part once")
    listed = []
    for name in names:
        part = found.get(name)
        if part is None or part.status != DONE:
            what = "was not uploaded" if part is None else "is still being uploaded"
            raise InvalidRequest(f"part {name!r} of {run}/{step} {what}")
        listed.append(part)
    return listed


def _renumber(s: Session, listed: list[PartRecord]) -> tuple[int, int]:
    """Number the parts' tensors on from each other's, in ``listed`` order: indices, and
    offsets in the checkpoint's data section. Returns the totals (tensors, bytes).

    Three statements however many parts (each part's shift a ``CASE`` on its id): one per
    part and table took 9 s for 1,024 parts on PostgreSQL (bench/control_plane.py)."""
    idx_of: dict[int, int] = {}
    begin_of: dict[int, int] = {}
    idx = begin = 0
    for p in listed:
        idx_of[p.id], begin_of[p.id] = idx, begin
        idx += p.n_tensors
        begin += p.raw_bytes
    ids = list(idx_of)
    t_part, c_part = _TENSORS.c.part_id, _CHUNKS.c.part_id
    # through negative numbers: the unique index on (checkpoint, part, idx) is checked row
    # by row, and shifting 0..n-1 up by less than n in place would collide
    s.execute(update(_TENSORS).where(t_part.in_(ids)).values(idx=-1 - _TENSORS.c.idx))
    s.execute(
        update(_TENSORS)
        .where(t_part.in_(ids))
        .values(
            idx=-1 - _TENSORS.c.idx + case(idx_of, value=t_part),
            begin=_TENSORS.c.begin + case(begin_of, value=t_part),
        )
    )
    s.execute(
        update(_CHUNKS)
        .where(c_part.in_(ids))
        .values(tensor_idx=_CHUNKS.c.tensor_idx + case(idx_of, value=c_part))
    )
    return idx, begin


def commit_parts(
    db: Database,
    run: str,
    step: int,
    names: Sequence[str],
    *,
    parent_id: int | None,
    keyframe: bool,
    since_keyframe: int,
    metadata: dict[str, str],
    fence: Lease | None = None,
) -> list[PartRecord]:
    """Make ``run/step`` visible, made of parts ``names`` in that order, in one transaction;
    returns the finished parts it does not name (the caller collects their blobs). The caller
    holds the run's lock, whose lease ``fence`` is checked first (LockLost, changing
    nothing). InvalidRequest if a named part is missing or not finished, or if two parts
    hold tensors of the same name."""
    with db.session() as s:
        if fence is not None:
            check_fence(s, fence)
        checkpoint_id = s.scalar(
            select(Checkpoint.id)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(Run.name == run, Checkpoint.step == step, Checkpoint.status == PARTS)
            .with_for_update(of=Checkpoint)  # a part finishing now commits first, or fails
        )
        if checkpoint_id is None:
            raise InvalidRequest(f"no part of {run}/{step} was uploaded")
        found = {
            p.name: _part(p)
            for p in s.scalars(select(Part).where(Part.checkpoint_id == checkpoint_id))
        }
        listed = _check_parts(found, names, run, step)
        clash = s.execute(
            select(TensorRow.name)
            .where(TensorRow.part_id.in_([p.id for p in listed]))
            .group_by(TensorRow.name)
            .having(func.count() > 1)
            .limit(1)
        ).scalar()
        if clash is not None:
            raise InvalidRequest(f"tensor {clash!r} is in more than one part of {run}/{step}")
        idx, begin = _renumber(s, listed)
        depth = s.scalar(
            select(func.max(Chunk.depth)).where(Chunk.part_id.in_([p.id for p in listed]))
        )
        keyframe = keyframe or not depth  # a keyframe holds no deltas
        figures = {
            "parent_id": parent_id,
            "keyframe": keyframe,
            "chain_depth": depth or 0,
            "since_keyframe": 0 if keyframe else since_keyframe,
            "raw_bytes": begin,
            "stored_bytes": sum(p.stored_bytes for p in listed),
            "n_tensors": idx,
            "n_parts": len(listed),
            "metadata_json": json.dumps(metadata),
            "committed_at": datetime.now(UTC),
            # chunks a writer encoded are decoded by the verifier before they count as checked
            "verification": PENDING if _client_parts(s, listed) else SERVICE,
        }
        try:
            s.execute(
                update(Checkpoint)
                .where(Checkpoint.id == checkpoint_id)
                .values(status=COMMITTED, **figures)
            )
        except IntegrityError as exc:  # a single-writer save of the same step won
            raise CheckpointExists(f"{run}/{step} was committed concurrently") from exc
    # a part still being written is left to its writer (its finish now fails) and the sweep
    return [p for p in found.values() if p.name not in names and p.status == DONE]


def _client_parts(s: Session, listed: list[PartRecord]) -> set[int]:
    """The ids of the parts of ``listed`` whose chunks their writers encoded."""
    ids = [p.id for p in listed]
    return set(s.scalars(select(Part.id).where(Part.id.in_(ids), Part.encoded_by == CLIENT)))


def committed_parts(db: Database, checkpoint_id: int) -> list[str]:
    """The names of a committed checkpoint's parts, in its order."""
    query = (
        select(Part.name, func.min(TensorRow.idx))
        .join(TensorRow, TensorRow.part_id == Part.id, isouter=True)
        .where(Part.checkpoint_id == checkpoint_id)
        .group_by(Part.id, Part.name)
    )
    with db.session() as s:
        rows = s.execute(query).all()
    return [name for name, _ in sorted(rows, key=lambda r: (r[1] is None, r[1] or 0))]


def parts_in_progress(db: Database) -> list[tuple[PartRecord, str, int]]:
    """Every ``writing`` part, with its run and step: those whose lock is free are
    orphans."""
    query = (
        select(Part, Run.name, Checkpoint.step)
        .join(Checkpoint, Checkpoint.id == Part.checkpoint_id)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Part.status == WRITING)
    )
    with db.session() as s:
        return [(_part(p), run, int(step)) for p, run, step in s.execute(query).all()]


def abandoned(db: Database, older_than: datetime) -> list[tuple[int, str, int, list[PartRecord]]]:
    """``(checkpoint_id, run, step, parts)`` of the ``parts`` checkpoints begun before
    ``older_than`` and never committed."""
    query = (
        select(Checkpoint.id, Run.name, Checkpoint.step, Checkpoint.created_at)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Checkpoint.status == PARTS)
    )
    out = []
    with db.session() as s:
        for checkpoint_id, run, step, created in s.execute(query).all():
            if utc(created) >= older_than:
                continue
            parts = [
                _part(p) for p in s.scalars(select(Part).where(Part.checkpoint_id == checkpoint_id))
            ]
            out.append((int(checkpoint_id), run, int(step), parts))
    return out
