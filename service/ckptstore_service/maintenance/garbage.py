"""Collecting blobs that nothing needs any more: those on the garbage table once they are
due (:func:`collect_garbage`), and those of uploads whose writer died
(:func:`collect_crashed_uploads`, at start-up).

Both keep invariant 7: a blob goes only once no checkpoint row names it, and a blob named by
a row goes before the row does, so a crash in between leaves a row whose next collection
finds the blob gone, never a blob that nothing names.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from ckptstore_core.errors import StorageUnavailable
from ckptstore_service.catalog import Catalog, PartRecord
from ckptstore_service.storage import BlobStore

__all__ = [
    "abandon_parts",
    "collect_crashed_uploads",
    "collect_garbage",
    "collect_parts",
    "delete_blob",
]

log = logging.getLogger("ckptstore")


def delete_blob(store: BlobStore, key: str) -> None:
    """Delete a blob a re-root wrote or replaced (idempotent); if it is not there, abort the
    write a crash may have cut short under its key."""
    if not store.exists(key):
        store.abort_incomplete([key])
    store.delete(key)


def collect_garbage(
    catalog: Catalog, store: BlobStore, run: str | None = None, now: datetime | None = None
) -> int:
    """Delete the blobs on the garbage table that are due, of ``run`` or of every run.
    Returns how many went.

    A run's rows are collected only while its re-root lock is free (a re-root holds it from
    before it names its new blobs until after its commit took them off the table), and a
    blob that a checkpoint names is never deleted. The blob goes first, then its row: a
    crash in between leaves a row, whose next collection finds the blob gone. An error on
    one blob leaves its row for the next collection and goes on with the others.
    """
    by_run: dict[str, list[tuple[int, str]]] = {}
    for gid, name, key in catalog.garbage(run, now or datetime.now(UTC)):
        by_run.setdefault(name, []).append((gid, key))
    gone = 0
    for name, items in by_run.items():
        with catalog.reroot_lock(name, blocking=False) as held:
            if held:
                gone += _collect(catalog, store, items)
    return gone


def _collect(catalog: Catalog, store: BlobStore, items: list[tuple[int, str]]) -> int:
    gone = 0
    for gid, key in items:
        try:
            if catalog.blob_in_use(key):
                log.error("blob %r is on the garbage table but a checkpoint names it: kept", key)
            else:
                delete_blob(store, key)
                gone += 1
            catalog.drop_garbage(gid)
        except Exception as exc:
            log.warning("cannot collect blob %r yet: %s", key, exc)
    return gone


def collect_crashed_uploads(catalog: Catalog, store: BlobStore, incomplete_ttl_s: float) -> int:
    """Delete the blobs and rows of uploads whose writer is gone; returns how many. Run at
    start-up, before the first request.

    A ``writing`` row whose run lock can be taken, and that is still ``writing`` once it is
    (the listing came before: a save may have committed since), has no live writer (a live
    upload holds the lock for its whole duration, on every replica), so its bytes are
    orphans. Partial
    writes older than ``incomplete_ttl_s`` go too. A store that refuses is logged, never
    raised.
    """
    dead = []
    for checkpoint_id, run, blob_key, _created in catalog.uploads_in_progress():
        with catalog.run_lock(run, blocking=False) as held:
            # looked at again under the lock: the upload may have committed since the listing
            if not held or not catalog.is_writing(checkpoint_id):
                continue
            try:
                store.abort_incomplete([blob_key])
                store.delete(blob_key)
            except (StorageUnavailable, OSError) as exc:
                # a read-only or full store still serves loads: start, and keep the row
                # for the next start-up to collect
                log.warning("cannot collect crashed upload %r yet: %s", blob_key, exc)
                continue
            catalog.abort_upload(checkpoint_id)
            dead.append(blob_key)
    # Writes with no catalog row left (a crash while aborting): found by age alone.
    try:
        stale = store.abort_incomplete((), incomplete_ttl_s)
    except (StorageUnavailable, OSError) as exc:
        log.warning("cannot collect stale partial writes yet: %s", exc)
        stale = 0
    if dead or stale:
        log.info("collected %d crashed upload(s), %d stale partial write(s)", len(dead), stale)
    return len(dead)


def collect_parts(catalog: Catalog, store: BlobStore, ttl_s: float) -> list[PartRecord]:
    """Delete the parts nobody will commit; returns those that went. Safe at any time.

    A ``writing`` part whose part lock is free has no writer (an upload holds it from before
    its row exists until its row is done or gone): its blob goes, then its row. A checkpoint
    whose parts began more than ``ttl_s`` ago and that no commit made visible is abandoned
    (a rank died, or the coordinator never called finish): each part whose lock is free goes
    the same way, then the checkpoint's row once it has no part left.

    What was listed is looked at again under the locks before anything goes
    (:meth:`Catalog.claim_part`): a part may have finished since, and an abandoned
    checkpoint is collected under its run's lock, which every commit holds, so it cannot be
    committed meanwhile (a commit after the sweep finds its parts gone).
    """
    gone = [
        part
        for part, run, step in catalog.parts_in_progress()
        if _collect_part(catalog, store, part, run, step)
    ]
    older_than = datetime.now(UTC) - timedelta(seconds=ttl_s)
    gone += _collect_abandoned(catalog, store, older_than)
    # uploads writers began straight to the store and never registered (a rank killed
    # mid-PUT): no part row names them; past the TTL their checkpoint is abandoned anyway
    try:
        aborted = store.abort_presigned_before(ttl_s)
    except (StorageUnavailable, OSError) as exc:
        log.warning("cannot abort stale presigned uploads yet: %s", exc)
        aborted = 0
    if aborted:
        log.info("aborted %d presigned upload(s) nobody registered", aborted)
    if gone:
        log.info("collected %d part(s) of checkpoints never committed", len(gone))
    return gone


def abandon_parts(
    catalog: Catalog, store: BlobStore, run: str, begun_before: datetime
) -> list[PartRecord]:
    """Treat ``run``'s checkpoints written in parts that began before ``begun_before`` and
    are not committed as abandoned now, as the sweep does ``CKPTSTORE_PARTS_TTL_S`` after
    they began (an admin delete's doing): the same collection, under the same locks. A part
    being uploaded right now (its lock held) stays; a later commit of such a checkpoint
    finds its parts gone. Returns the parts that went."""
    gone = _collect_abandoned(catalog, store, begun_before, run)
    if gone:
        log.warning(
            "abandoned %d uncommitted part(s) of run %r for an admin delete", len(gone), run
        )
    return gone


def _collect_abandoned(
    catalog: Catalog, store: BlobStore, older_than: datetime, only_run: str | None = None
) -> list[PartRecord]:
    """Collect the parts of the uncommitted checkpoints begun before ``older_than`` (of
    ``only_run``, or of every run), and each checkpoint's row once it has no part left."""
    gone: list[PartRecord] = []
    for checkpoint_id, run, step, parts in catalog.abandoned_parts(older_than):
        if only_run is not None and run != only_run:
            continue
        with catalog.run_lock(run, blocking=False) as held:
            if not held:  # a commit or a save of the run: the next sweep looks again
                continue
            went = [p for p in parts if _collect_part(catalog, store, p, run, step, older_than)]
            gone += went
            if len(went) == len(parts):
                catalog.drop_checkpoint(checkpoint_id)
    return gone


def _collect_part(
    catalog: Catalog,
    store: BlobStore,
    part: PartRecord,
    run: str,
    step: int,
    abandoned_before: datetime | None = None,
) -> bool:
    """Delete ``part`` if nobody writes it and it is still the sweep's to collect (still
    ``writing``, or of a checkpoint begun before ``abandoned_before`` and uncommitted);
    whether it went."""
    with catalog.part_lock(run, step, part.name, blocking=False) as held:
        if not held or not catalog.claim_part(part.id, abandoned_before):
            return False
        try:
            delete_blob(store, part.blob_key)
        except (StorageUnavailable, OSError) as exc:
            log.warning("cannot collect part blob %r yet: %s", part.blob_key, exc)
            return False
        catalog.drop_part(part.id)
        return True
