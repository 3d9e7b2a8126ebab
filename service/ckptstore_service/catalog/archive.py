"""Archival to the lossy tier: the catalog's side, one commit
(:mod:`ckptstore_service.maintenance.archive` does the work before it).

An archival is a rewrite of committed chunks (:func:`.garbage.apply_rewrite`, as a re-root's)
that changes the bytes of one checkpoint X: its lossy chunks get their reconstruction's
checksum, its tensors theirs (the checksum of the bytes they were sent as stays, in
``sent_checksum``: an idempotent retry of X's save still matches), and X is marked lossy
(``checkpoints.lossy_json``), all in the transaction that swaps the rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import func, select, update

from ckptstore_core.errors import CheckpointNotFound, CheckpointPinned, CorruptData
from ckptstore_service.catalog.db import Database
from ckptstore_service.catalog.garbage import RerootChanges, apply_rewrite
from ckptstore_service.catalog.lifecycle import _count_since_keyframe, _runs_of
from ckptstore_service.catalog.models import COMMITTED, Checkpoint, TensorRow

__all__ = ["ArchiveChanges", "commit_archive"]


@dataclass(frozen=True, slots=True)
class ArchiveChanges:
    """Everything one archival commit changes."""

    checkpoint_id: int  # X, the checkpoint made lossy
    lossy_json: str  # its lossy parameters (``Lossy.to_json()``, as JSON text)
    tensors: Sequence[tuple[int, bytes]]  # (idx, the reconstruction's checksum) of X's tensors
    # whose bytes changed
    rewrite: RerootChanges  # X's chunks, those re-based on them, their checkpoints' figures
    pairing_json: str | None = None  # what was paired (``Pairing.summary()``, JSON text)


def commit_archive(db: Database, run: str, changes: ArchiveChanges) -> None:
    """Make an archival visible, in one transaction, under the run's lock, once every new
    blob is durable: the rewrite's rows (:func:`.garbage.apply_rewrite`: chunks with their
    new checksums, checkpoints' figures, new blobs off the garbage table, replaced ones on
    it), X's tensors' checksums, X's ``lossy_json`` and ``pairing_json``, and
    ``since_keyframe`` counted again (X may stop being a keyframe, its successor become
    one). Raises, changing nothing:
    CheckpointNotFound if X is not committed any more, CheckpointPinned if it was pinned
    meanwhile (pinned checkpoints stay bit-exact), CorruptData if X is lossy already or a
    blob changed meanwhile."""
    x = changes.checkpoint_id
    with db.session() as s:
        row = s.execute(
            select(
                Checkpoint.status,
                Checkpoint.run_id,
                Checkpoint.pinned,
                Checkpoint.step,
                Checkpoint.lossy_json,
            )
            .where(Checkpoint.id == x)
            .with_for_update()
        ).first()
        if row is None or row.status != COMMITTED:
            raise CheckpointNotFound(f"checkpoint {x} of run {run!r} is gone")
        if row.pinned:
            raise CheckpointPinned(
                f"checkpoint {row.step} of run {run!r} was pinned during its archival: "
                "pinned checkpoints stay bit-exact"
            )
        if row.lossy_json is not None:
            raise CorruptData(f"checkpoint {row.step} of run {run!r} is lossy already")
        apply_rewrite(s, row.run_id, changes.rewrite)
        for idx, checksum in changes.tensors:
            s.execute(
                update(TensorRow)
                .where(TensorRow.checkpoint_id == x, TensorRow.idx == idx)
                # the bytes it was sent as: kept for an idempotent retry of its save
                .values(
                    sent_checksum=func.coalesce(TensorRow.sent_checksum, TensorRow.checksum),
                    checksum=checksum,
                )
            )
        s.execute(
            update(Checkpoint)
            .where(Checkpoint.id == x)
            .values(lossy_json=changes.lossy_json, pairing_json=changes.pairing_json)
        )
        _count_since_keyframe(s, {row.run_id, *_runs_of(s, changes.rewrite)})
