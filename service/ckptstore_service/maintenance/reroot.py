"""Re-rooting a run's chain after the fact.

Each link of a delta chain costs every load that goes through it (measured: ~16 ms per link,
end to end, on a 117 MB state). A save can only be a forward delta (the new checkpoint is all
it has), so the newest checkpoint of a segment is the deepest one. Once a save leaves it
``reroot_depth`` deltas deep, the service moves the segment's self-contained root to the
segment's middle checkpoint M, in the background: each chunk of M is stored whole, and the
chunks on its chain back to the old root become deltas the other way round, each of its
successor. Every delta still spans one checkpoint, so the bytes barely change (+0.3% on the
fine-tune bench), and both ends of the segment are half as deep.

What keeps it safe:

* Chunk rows keep their ids and their raw bytes (length, checksum): the refs and deltas of
  later checkpoints, whose base ids point into the rewritten chains, stay valid. Only a
  rewritten chunk's codec, base, depth and place in a blob change.
* Each checkpoint holding a rewritten chunk gets a new blob with all its chunks (the new
  encodings, the others copied). The new blobs are named in the ``garbage`` table before they
  are written, so a crash leaves no blob that nothing names; one transaction then updates the
  rows, takes the new blobs off that table and puts the old ones on it, due after
  ``garbage_grace_s``: a load that read the old rows before the commit still finds its blobs.
* Every new encoding is decoded back and checked against its chunk's checksum before anything
  is written, and the raw bytes it encodes were themselves checked when decoded.
* One re-root of a run runs at a time (its re-root lock, across replicas). Saves of the run
  go on meanwhile: a save's delta reads the newest checkpoint's rows, which keep their ids
  and bytes; the commit takes the run's lock and recomputes the depths of every chunk whose
  chain goes through a rewritten one, those of checkpoints saved meanwhile included.

The blobs a re-root replaces are collected by :func:`.garbage.collect_garbage`; the
background pass that sets re-roots off is :class:`.scheduler.Maintenance`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

from ckptstore_core import codec
from ckptstore_core.errors import RunNotFound
from ckptstore_core.lossy import LOSSY
from ckptstore_core.pipeline import Budget
from ckptstore_service.catalog import Catalog, CheckpointRecord, ChunkInfo
from ckptstore_service.chains import ChainDecoder, Piece
from ckptstore_service.maintenance.rewrite import (
    NewBlobs,
    Rewrite,
    Spools,
    Stopped,
    checked,
    checkpoint_figures,
    drop_new_blobs,
    encode_all,
    new_depths,
    polled_run_lock,
    rewrite_blob,
)
from ckptstore_service.names import blob_key
from ckptstore_service.settings import Settings
from ckptstore_service.storage import BlobStore

__all__ = [
    "RerootPolicy",
    "Rerooted",
    "Stopped",
    "reroot",
    "reroot_pool",
    "reroot_target",
]

log = logging.getLogger("ckptstore")


@dataclass(frozen=True, slots=True)
class RerootPolicy:
    """The settings a re-root follows (:meth:`of` takes them from the service's)."""

    depth: int  # re-root once the newest checkpoint is this deep (0: never)
    max_chain_depth: int  # no chunk may get deeper than this (one more for a bf16/f16 copy)
    zstd_level: int
    bytes_in_flight: int  # raw bytes of the chains re-encoded at once
    new_blob_due_s: float  # how long the new blobs stay off the collector's list
    grace_s: float  # how long the replaced blobs stay for the loads that read them
    # an archival's lossy chunks (:mod:`.archive`) get no deeper than this
    lossy_max_depth: int = 50

    @classmethod
    def of(cls, settings: Settings, budget: Budget) -> RerootPolicy:
        return cls(
            depth=settings.reroot_depth,
            max_chain_depth=settings.max_chain_depth,
            zstd_level=settings.zstd_level,
            bytes_in_flight=budget.bytes_in_flight,
            # the time a crashed upload is given: no collector takes a blob meanwhile
            new_blob_due_s=settings.incomplete_upload_ttl_s,
            grace_s=settings.garbage_grace_s,
            lossy_max_depth=settings.lossy_max_chain_depth,
        )


def reroot_target(
    catalog: Catalog, run: str, depth: int
) -> tuple[CheckpointRecord, list[CheckpointRecord]] | None:
    """Where to re-root the run's newest segment, and the run's checkpoints; None unless the
    newest checkpoint is ``depth`` deep (:attr:`RerootPolicy.depth`; 0: never).

    The new root is halfway from the segment's current root (its shallowest checkpoint) to
    the newest one: the newest becomes half as deep, and the checkpoints before the old root
    deeper. Once in a segment (the bench: 9 checkpoints, the root moves from the first to the
    fifth) both ends end up half as deep; a segment much longer than ``depth`` is
    re-rooted again every ``depth / 2`` saves or so, and its oldest checkpoints, the
    ones least often loaded, get deeper, up to ``max_chain_depth``: a re-root that would
    take a chunk past it is skipped (:func:`_too_deep`), and the newest checkpoint then
    deepens until ``max_chain_depth`` cuts its chains, as without re-rooting."""
    if not depth:
        return None
    # the newest alone first: this runs after every save, and a run may hold thousands
    latest = catalog.find(run, None)
    if latest is None or latest.chain_depth < depth:
        return None
    try:
        infos = catalog.list_checkpoints(run)
    except RunNotFound:
        return None
    if not infos or infos[-1].chain_depth < depth:
        return None
    by_step = {i.step: i for i in infos}
    segment = [infos[-1]]  # newest first
    while (
        segment[-1].since_keyframe > 0
        and segment[-1].parent_step in by_step
        and len(segment) < len(infos)
    ):
        segment.append(by_step[segment[-1].parent_step])
    root = min(range(len(segment)), key=lambda i: (segment[i].chain_depth, i))
    target = (root + 1) // 2  # how deep that makes the older chunks: see _too_deep
    return (segment[target], infos) if 0 < target < root else None


def _paths(decoder: ChainDecoder, tops: list[ChunkInfo]) -> list[list[ChunkInfo]]:
    """The chains to reverse, one per distinct chunk of the target that is a delta: each from
    the chunk it rests on (self-contained, or a copy of an fp32 master) up to the target's."""
    paths = []
    taken: set[int] = set()
    for c in tops:
        deltas, bottom = decoder.chain(c)
        path = [bottom, *reversed(deltas)]
        ids = {p.id for p in path}
        if deltas and not ids & taken:  # two refs to one chunk: its chain once
            taken |= ids
            paths.append(path)
    return paths


def _reverse(decoder: ChainDecoder, path: list[ChunkInfo], level: int) -> list[Rewrite]:
    """Re-encode one chain: its top stored whole, every other link a delta of its successor
    (or whole, where that delta does not pay)."""
    raws = [decoder.decode(path[0])]
    for p in path[1:]:
        links = [(codec.RAW, raws[-1]), (p.codec, decoder.fetch(p))]
        raws.append(codec.decode_chain(links, p.itemsize, p.raw_len, p.checksum))
    top = path[-1]
    enc = checked(codec.encode_chunk(raws[-1], None, top.itemsize, level), None, top)
    out = [Rewrite(top, enc.codec, None, 0, enc.parts)]
    depth = 0
    for j in range(len(path) - 2, -1, -1):
        p = path[j]
        base: Piece | None = raws[j + 1]
        enc = codec.encode_chunk(raws[j], base, p.itemsize, level)
        if not codec.is_delta(enc.codec):  # whole (a ref cannot be: it would have been one)
            enc, base = codec.encode_chunk(raws[j], None, p.itemsize, level), None
        checked(enc, base, p)
        depth = 0 if base is None else depth + 1
        out.append(
            Rewrite(p, enc.codec, None if base is None else path[j + 1].id, depth, enc.parts)
        )
    return out


@dataclass(frozen=True, slots=True)
class Rerooted:
    """What one re-root did: the chunk chains and chunks it rewrote, the checkpoints whose
    blob it replaced, the bytes of the blobs replaced (collected once the grace time has
    passed) and of the blobs written in their place."""

    chains: int
    chunks: int
    checkpoints: int
    bytes_replaced: int
    bytes_written: int


def reroot_pool(workers: int) -> ThreadPoolExecutor:
    """Threads for re-roots, apart from the codec pool that saves and loads share, and at a
    lower CPU priority: half as many as codec threads (at least one), niced."""
    return ThreadPoolExecutor(max(1, workers // 2), "ckptstore-reroot", initializer=_lower_priority)


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's nice is its own
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def reroot(
    catalog: Catalog,
    store: BlobStore,
    run: str,
    policy: RerootPolicy,
    *,
    scratch: Path,
    pool: Executor | None = None,
    stop: threading.Event | None = None,
) -> Rerooted | None:
    """Re-root the run's newest segment halfway if its newest checkpoint is
    ``policy.depth`` deep. Returns what it did, or None if it did nothing.

    The caller holds the run's re-root lock (:meth:`Catalog.reroot_lock`), not its lock: the
    decoding, encoding and blob writing run while the run's saves go on (a delta of the
    newest checkpoint does not read what changes), and the run's lock is taken for the
    commit only. The new encodings are spooled to unnamed files in ``scratch``. ``pool``
    runs the decoding and encoding (default: one thread of its own); ``stop``, when set,
    abandons the work between two chains or two blobs (raising :class:`Stopped`). A re-root
    that fails or stops deletes the blobs it wrote, and changes no row.
    """
    found = reroot_target(catalog, run, policy.depth)
    if found is None:
        return None
    target, infos = found
    t0 = time.perf_counter()
    tops, closure = catalog.chunk_tree(target.id)
    decoder = ChainDecoder(store, closure, 2 * policy.bytes_in_flight)
    paths = _paths(decoder, tops)
    if (
        not paths
        or _in_parts(paths, infos)
        or _in_other_runs(paths, infos)
        or _through_lossy(paths, infos)
        or _too_deep(catalog, paths, target, policy.max_chain_depth)
    ):
        return None
    spools = Spools(scratch)
    registered: list[str] = []  # on the garbage table, written or not
    committed = False
    jobs = [
        (len(path) * path[0].raw_len, partial(_reverse, decoder, path, policy.zstd_level))
        for path in paths
    ]
    try:
        if pool is None:
            with reroot_pool(2) as own:
                encode_all(jobs, spools, own, stop, policy.bytes_in_flight)
        else:
            encode_all(jobs, spools, pool, stop, policy.bytes_in_flight)
        info_of = {i.blob_key: i for i in infos}  # a re-root skips checkpoints in parts
        owners = sorted(spools.files)
        new_keys = {old: blob_key(run, info_of[old].step) for old in owners}
        # Named before they exist: a crash from here on leaves only blobs the table names.
        # Due only after the time a crashed upload is given: the collector must not take a
        # blob this re-root is about to commit (and the commit checks that it did not).
        due = datetime.now(UTC) + timedelta(seconds=policy.new_blob_due_s)
        registered = list(new_keys.values())
        new = NewBlobs(keys=new_keys, garbage_ids=catalog.add_garbage(run, registered, due))
        for old in owners:
            if stop is not None and stop.is_set():
                raise Stopped
            rows = catalog.chunks(info_of[old].id)
            rewrite_blob(store, rows, old, spools, new)
        with polled_run_lock(catalog, run, stop):
            _commit(catalog, run, spools, new, policy.grace_s)
            committed = True  # here: a failure to release the lock must not undo it
    finally:
        spools.close()
        if not committed:
            drop_new_blobs(catalog, store, registered)
    log.info(
        "re-rooted %s at step %d: %d chains, %d checkpoints rewritten, in %.2fs",
        run,
        target.step,
        len(paths),
        len(registered),
        time.perf_counter() - t0,
    )
    return Rerooted(
        chains=len(paths),
        chunks=len(spools.chunks),
        checkpoints=len(new.keys),
        bytes_replaced=sum(info_of[old].stored_bytes for old in new.keys),
        bytes_written=sum(new.stored.values()),
    )


def _in_parts(paths: list[list[ChunkInfo]], infos: list[CheckpointRecord]) -> bool:
    """Whether a chunk to rewrite belongs to a checkpoint written in parts: its chunks live
    in its parts' blobs, which a re-root (one new blob per checkpoint) does not rewrite.
    Such chains are left as they are, and deepen until ``max_chain_depth`` cuts them."""
    in_parts = {i.id for i in infos if i.parts > 1}
    if any(c.checkpoint_id in in_parts for path in paths for c in path):
        log.info(
            "not re-rooting %s: its chains pass through checkpoints written in parts", infos[-1].run
        )
        return True
    return False


def _in_other_runs(paths: list[list[ChunkInfo]], infos: list[CheckpointRecord]) -> bool:
    """Whether a chain to reverse runs into chunks that are not its committed checkpoints':
    another run's (a fork's chains rest on its source's), or the shared chunks a deleted
    checkpoint keeps (:mod:`.delete`): a re-root rewrites its own checkpoints' blobs only,
    under its own run's locks. Such chains are left as they are, until the next keyframe
    cuts them."""
    own = {i.id for i in infos}
    if any(c.checkpoint_id not in own for path in paths for c in path):
        log.info(
            "not re-rooting %s: its chains rest on another run's chunks (a fork) or on "
            "shared chunks of a deleted checkpoint",
            infos[-1].run,
        )
        return True
    return False


def _through_lossy(paths: list[list[ChunkInfo]], infos: list[CheckpointRecord]) -> bool:
    """Whether a chain to reverse holds a lossy link (an archived checkpoint's chunk,
    :mod:`.archive`): reversing it would store that checkpoint's reconstruction losslessly,
    undoing its archival. Such chains are left as they are, until the next keyframe."""
    if any(c.codec == LOSSY for path in paths for c in path):
        log.info("not re-rooting %s: its chains pass through lossy checkpoints", infos[-1].run)
        return True
    return False


def _too_deep(
    catalog: Catalog, paths: list[list[ChunkInfo]], target: CheckpointRecord, limit: int
) -> bool:
    """Whether reversing ``paths`` could take a chunk deeper than ``limit`` (the
    ``max_chain_depth``; one more for a bf16/f16 copy), counting every reversed link as a
    delta: chains that crossed a keyframe through a ref, or re-roots that moved far from a
    segment's first checkpoint, would otherwise let old checkpoints grow ever deeper."""
    upper = {p.id: len(path) - 1 - j for path in paths for j, p in enumerate(path)}
    depth, below = new_depths(catalog, upper)
    for c in below:
        allowed = limit + (codec.split_cast(c.codec) is not None)
        if depth[c.id] > max(allowed, c.depth):
            log.info(
                "not re-rooting %s at step %d: checkpoints before it would get %d deep",
                target.run,
                target.step,
                depth[c.id],
            )
            return True
    return False


def _commit(catalog: Catalog, run: str, spools: Spools, new: NewBlobs, grace_s: float) -> None:
    """Under the run's lock, once every new blob is durable: the depths of every chunk whose
    chain goes through a rewritten one (saves made meanwhile included), then one
    transaction (:meth:`Catalog.commit_reroot`); the replaced blobs are due ``grace_s``
    later."""
    depth, below = new_depths(catalog, {i: s.depth for i, s in spools.chunks.items()})
    infos = catalog.list_checkpoints(run)
    by_id = {i.id: i for i in infos}
    # chunks of forks of the run rest on its chunks: their depths follow too
    by_id.update(catalog.records_by_id({c.checkpoint_id for c in below} - by_id.keys()))
    rewritten = {i.id: i.blob_key for i in infos if i.blob_key in new.keys}
    updates = dict(new.rows)
    checkpoints = []
    for ck in sorted(set(rewritten) | {c.checkpoint_id for c in below}):
        old = rewritten.get(ck, by_id[ck].blob_key)
        checkpoints.append(
            checkpoint_figures(
                catalog,
                ck,
                depth,
                updates,
                old_blob_key=old,
                blob_key=new.keys.get(old, old),
                stored_bytes=new.stored.get(old, by_id[ck].stored_bytes),
            )
        )
    catalog.commit_reroot(
        run,
        chunks=list(updates.values()),
        checkpoints=checkpoints,
        written=new.garbage_ids,
        retired=list(new.keys),
        not_before=datetime.now(UTC) + timedelta(seconds=grace_s),
    )
