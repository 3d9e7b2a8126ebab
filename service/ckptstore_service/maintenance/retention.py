"""Applying a run's retention policy: deleting, with the delete machinery, every checkpoint
that the policy does not keep (:func:`ckptstore_core.retention.kept_steps` decides).

Run in the background (:class:`.scheduler.Maintenance`) after each save of the run and as
soon as a policy is set. What keeps it safe:

* Each checkpoint goes through :func:`.delete.delete_checkpoint`: the run's locks, the
  re-base of what rests on it, the one commit. Nothing here deletes by itself.
* The decision is made again under the run's locks, just before each delete (the
  ``check`` of :func:`~.delete.delete_checkpoint`), from a fresh listing and the policy as
  it is then: a save, pin or policy change since the pass began is taken into account, and
  the newest checkpoint is the newest at that moment. A pin that lands during the re-base
  refuses the delete at its commit.
* Two replicas applying the same policy at once queue on the run's locks; the second finds
  the checkpoint gone (CheckpointNotFound) and moves on: nothing is deleted twice, and
  nothing the policy keeps is lost.
* Loads in flight keep reading the deleted checkpoint's blobs for the garbage grace time
  (``CKPTSTORE_GARBAGE_GRACE_S``), as with any delete.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Executor
from pathlib import Path

from ckptstore_core.errors import CheckpointNotFound, CheckpointPinned, RunBusy, RunNotFound
from ckptstore_core.retention import Candidate, RetentionPolicy, kept_steps
from ckptstore_service.catalog import Catalog, CheckpointRecord
from ckptstore_service.maintenance.delete import delete_checkpoint
from ckptstore_service.maintenance.reroot import RerootPolicy
from ckptstore_service.storage import BlobStore

__all__ = ["apply_retention", "effective_policy", "retention_waiting", "steps_to_delete"]

log = logging.getLogger("ckptstore")


class _Kept(Exception):
    """The policy keeps the checkpoint after all (decided again under the run's locks)."""


def effective_policy(
    catalog: Catalog, run: str, default: RetentionPolicy | None
) -> RetentionPolicy | None:
    """The policy that applies to ``run``: its own if it has one, else ``default`` (the
    service's; None: keep everything)."""
    own = catalog.retention(run)
    return own if own is not None else default


def steps_to_delete(policy: RetentionPolicy | None, infos: list[CheckpointRecord]) -> list[int]:
    """The steps of ``infos`` (a run's committed checkpoints) that ``policy`` does not keep,
    oldest first."""
    candidates = [Candidate(i.step, i.pinned, i.metadata) for i in infos]
    kept = kept_steps(policy, candidates)
    return sorted(c.step for c in candidates if c.step not in kept)


def retention_waiting(catalog: Catalog, run: str, default: RetentionPolicy | None) -> str | None:
    """Why retention deletes none of ``run``'s checkpoints now although its policy (its own,
    else ``default``) would delete some: a checkpoint of the run being written in parts,
    whose parts may rest on their chunks. None when it is not held back."""
    retention = effective_policy(catalog, run, default)
    if retention is None or not retention.has_rules:
        return None
    try:
        doomed = steps_to_delete(retention, catalog.list_checkpoints(run))
    except RunNotFound:
        return None
    return _held_back(catalog, run, doomed)


def _held_back(catalog: Catalog, run: str, doomed: list[int]) -> str | None:
    """The reason of :func:`retention_waiting` for ``doomed`` steps, or None."""
    if not doomed:
        return None
    step = catalog.open_parts_step(run)
    if step is None:
        return None
    return (
        f"retention of {run!r} waits: it would delete {len(doomed)} checkpoint"
        f"{'s' if len(doomed) != 1 else ''}, but step {step} is being written in parts "
        "(uploaded, not committed), whose parts may rest on them; it deletes them once "
        "that checkpoint is committed, or abandoned (CKPTSTORE_PARTS_TTL_S after its first "
        "part) and collected"
    )


def apply_retention(
    catalog: Catalog,
    store: BlobStore,
    run: str,
    policy: RerootPolicy,
    default: RetentionPolicy | None,
    *,
    scratch: Path,
    pool: Executor,
    stop: threading.Event | None = None,
) -> list[int]:
    """Delete the checkpoints of ``run`` that its retention policy (its own, else
    ``default``) does not keep; returns the steps this call deleted. A checkpoint gone
    meanwhile, pinned meanwhile or kept after all is skipped; a run with a checkpoint being
    written in parts is left for the pass after that commit, and the log says so
    (:func:`retention_waiting`, which the run's listing shows too). Stops between deletes once
    ``stop`` is set."""
    retention = effective_policy(catalog, run, default)
    if retention is None or not retention.has_rules:
        return []
    try:
        doomed = steps_to_delete(retention, catalog.list_checkpoints(run))
    except RunNotFound:
        return []
    held = _held_back(catalog, run, doomed)
    if held is not None:
        log.warning("%s", held)
        return []

    def still_doomed(x: CheckpointRecord) -> None:
        now = effective_policy(catalog, run, default)
        if x.step not in steps_to_delete(now, catalog.list_checkpoints(run)):
            raise _Kept

    deleted: list[int] = []
    for step in doomed:
        if stop is not None and stop.is_set():
            break
        try:
            delete_checkpoint(
                catalog,
                store,
                run,
                step,
                policy,
                scratch=scratch,
                pool=pool,
                check=still_doomed,
            )
        except (_Kept, CheckpointNotFound, CheckpointPinned):
            continue  # kept after all, deleted by another replica, or pinned meanwhile
        except RunBusy as exc:  # parts began meanwhile
            log.warning("retention of %r stopped: %s", run, exc)
            break
        except RunNotFound as exc:
            log.info("retention of %r stopped: %s", run, exc)
            break
        deleted.append(step)
    if deleted:
        log.info(
            "retention (%s) deleted %d checkpoints of %s: %s", retention, len(deleted), run, deleted
        )
    return deleted
