"""Pins and retention policies: the catalog's side of them.

A checkpoint's ``pinned`` flag (``checkpoints.pinned``) keeps it from every delete: a
delete's commit reads it under the checkpoint row's lock (:func:`.lifecycle.commit_delete`),
so a pin that lands while a delete re-bases refuses that delete, and a delete that commits
first leaves nothing to pin (:class:`~ckptstore_core.errors.CheckpointNotFound`). A run's
retention policy is a JSON column of its row (``runs.retention_json``; NULL: none of its
own). :mod:`ckptstore_service.maintenance.retention` applies it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from sqlalchemy import select, update

from ckptstore_core.errors import CheckpointPinned
from ckptstore_core.retention import RetentionPolicy
from ckptstore_service.catalog import checkpoints
from ckptstore_service.catalog.db import Database
from ckptstore_service.catalog.models import COMMITTED, Checkpoint, Run
from ckptstore_service.catalog.records import CheckpointRecord

__all__ = ["pinned_refusal", "retention", "set_pinned", "set_retention"]


def pinned_refusal(run: str, steps: Sequence[int]) -> CheckpointPinned:
    """The error of a delete that would take the pinned checkpoints ``steps`` of ``run``."""
    shown = ", ".join(str(s) for s in sorted(steps))
    which = (
        f"checkpoint {shown} of run {run!r} is"
        if len(steps) == 1
        else (f"checkpoints {shown} of run {run!r} are")
    )
    first = sorted(steps)[0]
    return CheckpointPinned(
        f"{which} pinned: pinned checkpoints are never deleted; unpin first "
        f"(`ckptstore unpin {run}@{first}`, or client.unpin({run!r}, {first}))"
    )


def set_pinned(db: Database, run: str, step: int, pinned: bool) -> CheckpointRecord:
    """Pin (or unpin) committed checkpoint ``step`` of ``run``; returns it as listed then.
    RunNotFound / CheckpointNotFound if there is none (deleted meanwhile included)."""
    target = (
        select(Checkpoint.id)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(Run.name == run, Checkpoint.step == step, Checkpoint.status == COMMITTED)
        .scalar_subquery()
    )
    with db.session() as s:
        s.execute(
            update(Checkpoint)
            .where(Checkpoint.id == target, Checkpoint.status == COMMITTED)
            .values(pinned=pinned)
        )
    return checkpoints.get(db, run, step)  # the errors, when nothing was there to update


def set_retention(db: Database, run: str, policy: RetentionPolicy | None) -> None:
    """Store ``policy`` as ``run``'s own (None: clear it, the service's default applies).
    The run's row is made if it has none: a policy may be set before the first save."""
    run_id = checkpoints.ensure_run(db, run)
    text = None if policy is None else json.dumps(policy.to_json(), separators=(",", ":"))
    with db.session() as s:
        s.execute(update(Run).where(Run.id == run_id).values(retention_json=text))


def retention(db: Database, run: str) -> RetentionPolicy | None:
    """``run``'s own retention policy, None if it has none (or no row: RunNotFound only
    from callers that need the run)."""
    with db.session() as s:
        text = s.scalar(select(Run.retention_json).where(Run.name == run))
    return None if text is None else RetentionPolicy.from_json(json.loads(text))
