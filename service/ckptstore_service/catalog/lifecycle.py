"""Deleting committed checkpoints and runs: the catalog's side of it.

:mod:`ckptstore_service.maintenance.delete` re-bases the chunks that rest on a deleted
checkpoint's and writes their new blobs; here is the one transaction that then makes the
delete visible (:func:`commit_delete`), and the one that deletes a whole run
(:func:`delete_run`). Both are called under the run's lock and its re-root lock.

A deleted checkpoint's row is not removed: it stays as a *tombstone* (status ``deleted``, no
tensors, parts or parent), invisible like every row that is not ``committed``, so that its
id is never given to another checkpoint (SQLite reuses the largest rowid once its row is
gone; the base cache of every replica is keyed by checkpoint id). Its blobs go on the
garbage table, due after the grace time for loads in progress.

A tombstone may keep some chunk rows: its *shared chunks*, which other checkpoints refer to
(a frozen tensor's refs, a fork's) and which a delete therefore keeps instead of copying
them into every blob that refers to them (:func:`.graph.shared_chunks`). It then keeps one
blob, holding those chunks (its own blob as it was, or a new one holding only them), and
``stored_bytes`` are that blob's. The chunk rows are their own reference counts: a shared
chunk goes, in the transaction that takes away the last chunk resting on it
(:func:`_prune`), and a tombstone left with no chunk gives its blob to the garbage table.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import bindparam, delete, exists, select, update
from sqlalchemy.orm import Session, aliased

from ckptstore_core.errors import CheckpointNotFound, CorruptData, RunNotFound
from ckptstore_service.catalog.db import Database
from ckptstore_service.catalog.garbage import RerootChanges, apply_rewrite, retire
from ckptstore_service.catalog.models import (
    COMMITTED,
    DELETED,
    PARTS,
    Base,
    Checkpoint,
    Chunk,
    Garbage,
    Part,
    Run,
    TensorRow,
)
from ckptstore_service.catalog.records import ChunkUpdate
from ckptstore_service.catalog.retention import pinned_refusal

__all__ = [
    "DeleteChanges",
    "KeptChunks",
    "PartBlob",
    "commit_delete",
    "delete_run",
    "open_parts_step",
    "part_blobs",
]

_CHUNKS = Base.metadata.tables[Chunk.__tablename__]
# ids per statement (bound parameters per statement are limited)
_BATCH = 500


def open_parts_step(db: Database, run: str) -> int | None:
    """The step of a checkpoint of ``run`` being written in parts (uploaded, not committed
    yet), if there is one: its parts' chunks rest on committed chunks the catalog cannot see
    yet (a part that is still streaming has no rows)."""
    query = (
        select(Checkpoint.step)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Run.name == run, Checkpoint.status == PARTS)
        .limit(1)
    )
    with db.session() as s:
        step = s.scalar(query)
    return None if step is None else int(step)


@dataclass(frozen=True, slots=True)
class PartBlob:
    """A part's blob, as it is (``blob_key``) or as a rewrite leaves it (``new_blob_key``)."""

    part_id: int
    blob_key: str
    stored_bytes: int
    new_blob_key: str = ""


def part_blobs(db: Database, checkpoint_id: int) -> list[PartBlob]:
    """The blobs of checkpoint ``checkpoint_id``'s parts (none unless written in parts)."""
    query = (
        select(Part.id, Part.blob_key, Part.stored_bytes)
        .where(Part.checkpoint_id == checkpoint_id)
        .order_by(Part.id)
    )
    with db.session() as s:
        return [PartBlob(int(i), k, int(n)) for i, k, n in s.execute(query).all()]


@dataclass(frozen=True, slots=True)
class KeptChunks:
    """The shared chunks a delete keeps (:func:`.graph.shared_chunks`) and the blob that
    holds them from its commit on: the checkpoint's own as it is (``rows`` empty), or a new
    blob holding only them (``rows``: their places in it; ``written``: its garbage row)."""

    ids: frozenset[int]
    blob_key: str
    stored_bytes: int
    rows: Sequence[ChunkUpdate] = ()
    written: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class DeleteChanges:
    """Everything one delete commit changes."""

    checkpoint_id: int  # the checkpoint deleted
    rebase: RerootChanges  # the re-based chunks and what follows from them
    parts: Sequence[PartBlob]  # the parts whose blob the re-base rewrote (new_blob_key set)
    kept: KeptChunks | None = None  # its shared chunks, if any


def commit_delete(db: Database, run: str, changes: DeleteChanges) -> list[str]:
    """Make a delete visible, in one transaction; returns the deleted checkpoint's blobs
    (named as garbage, due with the replaced ones).

    The re-base's rows (:func:`.garbage.apply_rewrite`: chunks, checkpoints' figures, new
    blobs off the garbage table, replaced blobs on it), the parts' new blobs, the
    checkpoint's children linked to its parent, its tensor, chunk and part rows deleted, its
    row a tombstone, and ``since_keyframe`` counted again along the run. Raises
    CheckpointNotFound if the checkpoint is not committed (any more), CheckpointPinned if it
    was pinned meanwhile, CorruptData if a blob changed meanwhile; each changes nothing.
    """
    x = changes.checkpoint_id
    with db.session() as s:
        row = s.execute(
            select(
                Checkpoint.status,
                Checkpoint.parent_id,
                Checkpoint.blob_key,
                Checkpoint.run_id,
                Checkpoint.pinned,
                Checkpoint.step,
            )
            .where(Checkpoint.id == x)
            .with_for_update()
        ).first()
        if row is None or row.status != COMMITTED:
            raise CheckpointNotFound(f"checkpoint {x} of run {run!r} is gone")
        if row.pinned:
            raise pinned_refusal(run, [row.step])
        _move_parts(s, changes.parts)
        apply_rewrite(s, row.run_id, changes.rebase)
        s.execute(
            update(Checkpoint).where(Checkpoint.parent_id == x).values(parent_id=row.parent_id)
        )
        blobs = [row.blob_key, *s.scalars(select(Part.blob_key).where(Part.checkpoint_id == x))]
        kept = changes.kept
        _tombstone(s, [x], keep=True)  # its chunks go through _prune: their bases may too
        if kept is not None:
            _keep(s, x, kept)
            blobs = [k for k in blobs if k != kept.blob_key]
        retire(s, row.run_id, blobs, changes.rebase.not_before)
        ids = list(s.scalars(select(Chunk.id).where(Chunk.checkpoint_id == x)))
        emptied = _prune(s, ids)
        left = set(s.scalars(select(Chunk.id).where(Chunk.checkpoint_id == x)))
        if left != (set() if kept is None else kept.ids):
            raise CorruptData(f"the shared chunks of checkpoint {x} changed during its delete")
        _release(s, emptied - {x}, changes.rebase.not_before)
        _count_since_keyframe(s, {row.run_id, *_runs_of(s, changes.rebase)})
    return [k for k in blobs if k]


def _keep(s: Session, x: int, kept: KeptChunks) -> None:
    """Tombstone ``x`` keeps its shared chunks in ``kept.blob_key`` (in a new blob: their
    rows moved there, out of any part, and the new blob off the garbage table)."""
    if kept.rows:
        s.execute(
            update(_CHUNKS)
            .where(_CHUNKS.c.id == bindparam("b_id"))
            .values(blob_offset=bindparam("b_offset"), part_id=0),
            [{"b_id": r.id, "b_offset": r.blob_offset} for r in kept.rows],
        )
    if kept.written:
        taken = s.execute(
            delete(Garbage).where(Garbage.id.in_(list(kept.written))).returning(Garbage.id)
        ).all()
        if len(taken) != len(kept.written):  # a collector took it: it may be gone
            raise CorruptData("the blob of a delete's shared chunks was collected before it")
    s.execute(
        update(Checkpoint)
        .where(Checkpoint.id == x)
        .values(blob_key=kept.blob_key, stored_bytes=kept.stored_bytes)
    )


def _prune(s: Session, candidates: Collection[int]) -> set[int]:
    """Delete, among the chunks ``candidates``, those of deleted checkpoints that no chunk
    rests on any more, then the bases that this leaves so, and so on (the chunk rows are
    the reference counts of shared chunks). Returns the checkpoints that lost chunks."""
    dep = aliased(Chunk)
    touched: set[int] = set()
    todo = sorted(set(candidates))
    while todo:
        bases: set[int] = set()
        for i in range(0, len(todo), _BATCH):
            rows = s.execute(
                select(Chunk.id, Chunk.base_id, Chunk.checkpoint_id)
                .join(Checkpoint, Checkpoint.id == Chunk.checkpoint_id)
                .where(
                    Chunk.id.in_(todo[i : i + _BATCH]),
                    Checkpoint.status == DELETED,
                    ~exists().where(dep.base_id == Chunk.id),
                )
            ).all()
            if rows:
                s.execute(delete(Chunk).where(Chunk.id.in_([r.id for r in rows])))
            bases |= {r.base_id for r in rows if r.base_id is not None}
            touched |= {r.checkpoint_id for r in rows}
        todo = sorted(bases)
    return touched


def _release(s: Session, ids: Collection[int], not_before: datetime) -> None:
    """The deleted checkpoints ``ids`` that keep no shared chunk any more give up their
    blob: garbage from ``not_before``."""
    for checkpoint_id in sorted(ids):
        if s.scalar(select(Chunk.id).where(Chunk.checkpoint_id == checkpoint_id).limit(1)):
            continue
        row = s.execute(
            select(Checkpoint.run_id, Checkpoint.blob_key).where(
                Checkpoint.id == checkpoint_id, Checkpoint.status == DELETED
            )
        ).first()
        if row is None or not row.blob_key:
            continue
        retire(s, row.run_id, [row.blob_key], not_before)
        s.execute(
            update(Checkpoint)
            .where(Checkpoint.id == checkpoint_id)
            .values(blob_key="", stored_bytes=0)
        )


def _move_parts(s: Session, parts: Sequence[PartBlob]) -> None:
    """Point the parts a re-base rewrote at their new blobs; CorruptData if one changed."""
    for p in parts:
        moved = s.execute(
            update(Part)
            .where(Part.id == p.part_id, Part.blob_key == p.blob_key)
            .values(blob_key=p.new_blob_key, stored_bytes=p.stored_bytes)
            .returning(Part.id)
        ).all()
        if len(moved) != 1:
            raise CorruptData(f"part {p.part_id} changed during a delete's re-base")


def _runs_of(s: Session, rebase: RerootChanges | None) -> set[int]:
    """The runs of the checkpoints a re-base changes (forks of the run deleted from)."""
    ids = [] if rebase is None else [c.id for c in rebase.checkpoints]
    if not ids:
        return set()
    return {int(r) for r in s.scalars(select(Checkpoint.run_id).where(Checkpoint.id.in_(ids)))}


def _tombstone(s: Session, ids: list[int], *, keep: bool = False) -> None:
    """Delete the rows of checkpoints ``ids`` but their own, which become tombstones (with
    ``keep``: their chunk rows stay too, for :func:`_prune` to go through).

    One checkpoint per statement, so that no statement outlives the database deadline
    (CKPTSTORE_DATABASE_TIMEOUT_S) however large the run: a whole run's chunk rows in one
    statement took 18.5 s per million. With several checkpoints, their chunks' links to
    each other go first (a re-root may have based an older checkpoint's chunk on a newer
    one's), so that each delete leaves no remaining row pointing at a deleted one."""
    if len(ids) > 1:
        for checkpoint_id in ids:
            unlink = update(Chunk).where(
                Chunk.checkpoint_id == checkpoint_id, Chunk.base_id.is_not(None)
            )
            s.execute(unlink.values(base_id=None))
    for checkpoint_id in ids:
        if not keep:
            s.execute(delete(Chunk).where(Chunk.checkpoint_id == checkpoint_id))
        s.execute(delete(TensorRow).where(TensorRow.checkpoint_id == checkpoint_id))
    s.execute(delete(Part).where(Part.checkpoint_id.in_(ids)))
    s.execute(
        update(Checkpoint)
        .where(Checkpoint.id.in_(ids))
        .values(status=DELETED, blob_key="", stored_bytes=0, parent_id=None)
    )


def _count_since_keyframe(s: Session, run_ids: set[int]) -> None:
    """``since_keyframe`` of the runs' committed checkpoints, counted again by step (a save
    reads its parent's to decide on a keyframe; a delete takes one out of the count, a
    re-base may make a fork's checkpoint a keyframe)."""
    for run_id in sorted(run_ids):
        _count_run_since_keyframe(s, run_id)


def _count_run_since_keyframe(s: Session, run_id: int) -> None:
    rows = s.execute(
        select(Checkpoint.id, Checkpoint.keyframe, Checkpoint.since_keyframe)
        .where(Checkpoint.run_id == run_id, Checkpoint.status == COMMITTED)
        .order_by(Checkpoint.step)
    ).all()
    since = -1
    for checkpoint_id, keyframe, old in rows:
        since = 0 if keyframe or since < 0 else since + 1
        if since != old:
            query = update(Checkpoint).where(Checkpoint.id == checkpoint_id)
            s.execute(query.values(since_keyframe=since))


def delete_run(
    db: Database,
    run: str,
    not_before: datetime,
    rebase: RerootChanges | None = None,
    parts: Sequence[PartBlob] = (),
) -> tuple[int, list[str]]:
    """Delete every committed checkpoint of ``run``, in one transaction: each becomes a
    tombstone, and its blobs (its own, its parts') garbage from ``not_before``. Returns how
    many went and their blobs; RunNotFound if the run has none, CheckpointPinned (nothing
    deleted) if one of them is pinned.

    The run's row stays: the garbage rows name it (and would go with it), and a later save
    under the same name starts a fresh chain in it. Chunks of other runs (forks) that rest
    on this run's are re-based first, by the caller; ``rebase`` and ``parts`` (as
    :func:`commit_delete` takes them) are their rows, applied in the same transaction.
    """
    with db.session() as s:
        run_id = s.scalar(select(Run.id).where(Run.name == run).with_for_update())
        rows = (
            []
            if run_id is None
            else s.execute(
                select(
                    Checkpoint.id, Checkpoint.blob_key, Checkpoint.step, Checkpoint.pinned
                ).where(Checkpoint.run_id == run_id, Checkpoint.status == COMMITTED)
            ).all()
        )
        if run_id is None or not rows:
            raise RunNotFound(f"run {run!r} has no checkpoints")
        pinned = [int(r.step) for r in rows if r.pinned]
        if pinned:
            raise pinned_refusal(run, pinned)
        _move_parts(s, parts)
        if rebase is not None:
            apply_rewrite(s, run_id, rebase)
        # the run's deleted checkpoints that keep shared chunks go with it
        sharing = s.execute(
            select(Checkpoint.id, Checkpoint.blob_key).where(
                Checkpoint.run_id == run_id,
                Checkpoint.status == DELETED,
                Checkpoint.blob_key != "",
            )
        ).all()
        ids = [int(r.id) for r in rows]
        everything = ids + [int(r.id) for r in sharing]
        blobs = [r.blob_key for r in rows] + [r.blob_key for r in sharing]
        blobs += s.scalars(select(Part.blob_key).where(Part.checkpoint_id.in_(ids))).all()
        bases = _bases_of(s, everything)
        _tombstone(s, everything)
        retire(s, run_id, blobs, not_before)
        # shared chunks of other runs that only the run's chunks rested on
        _release(s, _prune(s, bases), not_before)
        _count_since_keyframe(s, _runs_of(s, rebase))
    return len(ids), [k for k in blobs if k]


def _bases_of(s: Session, ids: list[int]) -> set[int]:
    """The chunks that the chunks of checkpoints ``ids`` rest on."""
    found: set[int] = set()
    for i in range(0, len(ids), _BATCH):
        query = select(Chunk.base_id).where(
            Chunk.checkpoint_id.in_(ids[i : i + _BATCH]), Chunk.base_id.is_not(None)
        )
        found |= {int(b) for b in s.scalars(query.distinct()) if b is not None}
    return found
