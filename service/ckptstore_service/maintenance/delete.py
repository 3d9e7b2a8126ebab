"""Deleting a checkpoint, or a whole run, without changing a byte that any other checkpoint
loads to (invariant 7).

Any checkpoint X may go: the newest, the oldest, a keyframe, the middle of a chain.

X's chunks that other checkpoints refer to (codec ``ref``: a frozen tensor stored once by X
and referred to by every later checkpoint, a fork's first checkpoint) are *shared*: they
are kept, rows of X's tombstone, and what refers to them (or rests on them) stays as it is
(:meth:`Catalog.shared_chunks`). Where X's blob holds more than them, they are copied once
into a blob of their own (at most X's stored bytes), X's blob going to the garbage table;
a later delete refers to that blob as it is. The chunk rows are their reference counts: a
shared chunk goes in the commit that removes the last chunk resting on it, and its blob
once none of them is left (:mod:`ckptstore_service.catalog.lifecycle`). Re-basing them
instead wrote a new blob for every checkpoint referring to them: O(run length) per delete.

The other chunks of other checkpoints whose base is one of X's (later deltas; after a
re-root, earlier ones too) are *re-based*: each is decoded, re-encoded against the first
chunk on its base's chain that is not X's (or where there is none, or the chain runs into a
bf16/f16 copy's fp32 master: the first chunk resting on the same chunk of X is stored whole
and the others are re-encoded against it, so refs to a frozen tensor stay refs; whole
wherever a delta does not pay), and the new encoding is decoded back and checked against
the chunk's checksum before anything is written. Chunk rows keep their ids and raw bytes;
only codec, base, depth and place in a blob change, exactly as in a re-root
(:mod:`.rewrite` holds what both share). Chains never get deeper: a re-based delta skips
one link.

What keeps it safe:

* The run's re-root lock and its lock are held from the first read to the commit: no save,
  commit of parts or re-root of the run interleaves (saves to the run wait for a delete).
  A run with a checkpoint being written in parts (uploaded, not committed) refuses deletes
  (:class:`~ckptstore_core.errors.RunBusy`): its parts may rest on X's chunks without the
  catalog knowing yet.
* Every blob holding a re-based chunk (a checkpoint's own, or one of its parts') is written
  anew under a new key, named on the garbage table before it is written. One transaction
  (:meth:`Catalog.commit_delete`) then commits the new rows, takes the new blobs off the
  table, puts the replaced blobs and X's own on it due after ``garbage_grace_s``, links X's
  children to X's parent, recomputes the depths and keyframe flags of everything whose
  chain went through X, and leaves X's row as a tombstone (its id is never reused). A crash
  before that commit leaves X whole and the new blobs on the table; after it, X is gone
  and its blobs wait on the table. Either way the next collection finds every extra blob.
* Loads in flight keep reading the rows they read and the old blobs, which stay for the
  grace time; a load that starts after the commit gets 404 for X
  (:class:`~ckptstore_service.restore.Loader` turns a checkpoint that vanished between its
  catalog reads into a 404) and the exact bytes of every other checkpoint.
* Chunks of other runs may rest on X's: a fork's refs (:mod:`.fork`) and its later saves'
  deltas. They are re-based like the run's own, into new blobs of their own runs, under
  those runs' re-root locks and locks too (taken after X's run's: a fork is younger than
  its source, so the order never loops). A whole run's delete (:func:`delete_run`)
  re-bases the chunks of other runs resting on any of its checkpoints, in the same
  transaction that deletes it: no byte another run loads is ever lost.
* A deleted checkpoint's base-cache file is never served nor used as a save's base: the
  cache is keyed by checkpoint id, and X's id never names another checkpoint
  (:mod:`ckptstore_service.cache_policy`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from contextlib import ExitStack
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

from ckptstore_core import codec
from ckptstore_core.errors import CorruptData, RunBusy
from ckptstore_service.catalog import (
    Catalog,
    CheckpointRecord,
    CheckpointUpdate,
    ChunkInfo,
    DeleteChanges,
    KeptChunks,
    PartBlob,
)
from ckptstore_service.catalog.garbage import RerootChanges
from ckptstore_service.catalog.retention import pinned_refusal
from ckptstore_service.chains import ChainDecoder
from ckptstore_service.maintenance.garbage import abandon_parts
from ckptstore_service.maintenance.reroot import RerootPolicy
from ckptstore_service.maintenance.rewrite import (
    NewBlobs,
    Rewrite,
    Spools,
    checked,
    checkpoint_figures,
    drop_new_blobs,
    encode_all,
    rewrite_blob,
)
from ckptstore_service.names import blob_key
from ckptstore_service.storage import BlobStore

__all__ = ["Deleted", "delete_checkpoint", "delete_run", "make_way_for_admin_delete"]

log = logging.getLogger("ckptstore")


@dataclass(frozen=True, slots=True)
class Deleted:
    """What one delete did: the checkpoint that went, the chunks of other checkpoints it
    re-based, the blobs it wrote in place of others and their bytes (the new blob of its
    shared chunks included), the stored bytes that go once the garbage is collected (X's
    blobs, and the replaced blobs, less the new and the shared chunks kept), and the shared
    chunks it kept."""

    checkpoint: CheckpointRecord
    chunks: int
    blobs: int
    bytes_rewritten: int
    bytes_freed: int
    seconds: float
    shared_chunks: int = 0  # its chunks that others refer to: kept, not copied
    shared_bytes: int = 0  # their stored bytes (in a blob of their own, or its blob as is)


def make_way_for_admin_delete(
    catalog: Catalog, store: BlobStore, run: str, wait_s: float, *, poll_s: float = 0.2
) -> None:
    """Before an admin delete of ``run`` (a checkpoint, or the run): wait up to ``wait_s``
    seconds for its checkpoint being written in parts, if any, to be committed; past that,
    abandon it (:func:`~.garbage.abandon_parts`): its parts are collected, and its writers'
    commit later fails. A part being uploaded at that moment stays, and the delete is then
    ``run_busy`` as before. Retention never calls this: it waits for the commit."""
    deadline = time.monotonic() + wait_s
    while catalog.open_parts_step(run) is not None:
        if time.monotonic() >= deadline:
            abandon_parts(catalog, store, run, datetime.now(UTC))
            return
        time.sleep(poll_s)


def _check_not_busy(catalog: Catalog, run: str) -> None:
    step = catalog.open_parts_step(run)
    if step is not None:
        raise RunBusy(
            f"run {run!r} has a checkpoint being written in parts (step {step}), a part of "
            "which is being uploaded: delete once it is committed (or abandoned)"
        )


def delete_checkpoint(
    catalog: Catalog,
    store: BlobStore,
    run: str,
    step: int,
    policy: RerootPolicy,
    *,
    scratch: Path,
    pool: Executor,
    check: Callable[[CheckpointRecord], None] | None = None,
) -> Deleted:
    """Delete checkpoint ``step`` of ``run`` (see the module's docstring); returns what it
    did. Raises RunNotFound / CheckpointNotFound if there is none, RunBusy while the run (or
    a run resting on it: a fork) has a checkpoint being written in parts. Takes the run's
    re-root lock, then its lock, then those of the runs whose chunks rest on the checkpoint's
    (forks: :func:`_lock_dependents`), and holds them throughout. ``pool`` runs the decoding
    and encoding; the new encodings are spooled to unnamed files in ``scratch``. A delete
    that fails changes no row and deletes what it wrote. CheckpointPinned for a pinned
    checkpoint (a pin that lands during the re-base refuses it at the commit). ``check``, if
    given, is called with the checkpoint under the locks before any work: it raises to call
    the delete off (retention re-decides there, :mod:`.retention`)."""
    t0 = time.perf_counter()
    with ExitStack() as held:
        _lock_run(held, catalog, run)
        x = catalog.get(run, step)
        if x.pinned:
            raise pinned_refusal(run, [step])
        if check is not None:
            check(x)
        _check_not_busy(catalog, run)
        shared = catalog.shared_chunks(x.id)

        def rebased() -> list[ChunkInfo]:  # what rests on a shared chunk stays as it is
            return [d for d in catalog.dependents(x.id) if d.base_id not in shared]

        deps = _lock_dependents(held, catalog, run, rebased)
        own = catalog.chunks(x.id)
        gone = {c.id for c in own} - shared
        kept = _keep_shared(catalog, store, run, x, [c for c in own if c.id in shared], policy)
        committed = False
        try:

            def commit(rebase: RerootChanges, parts: list[PartBlob]) -> None:
                catalog.commit_delete(run, DeleteChanges(x.id, rebase, parts, kept))

            chunks, new, replaced = _rebase_and_commit(
                catalog, store, run, (gone, {x.id}), deps, policy, scratch, pool, commit
            )
            committed = True
        finally:
            if kept is not None and kept.rows and not committed:
                drop_new_blobs(catalog, store, [kept.blob_key])
    written = sum(new.stored.values())
    moved = 0 if kept is None or not kept.rows else kept.stored_bytes
    still = 0 if kept is None else kept.stored_bytes
    done = Deleted(
        checkpoint=x,
        chunks=chunks,
        blobs=len(new.keys),
        bytes_rewritten=written + moved,
        bytes_freed=x.stored_bytes + replaced - written - still,
        seconds=time.perf_counter() - t0,
        shared_chunks=len(shared),
        shared_bytes=still,
    )
    log.info(
        "deleted %s/%d: %d chunks of %d blobs re-based, %d shared chunks kept (%d bytes, "
        "%d moved to a blob of their own) (%d bytes written), in %.2fs",
        run,
        step,
        done.chunks,
        done.blobs,
        len(shared),
        still,
        moved,
        done.bytes_rewritten,
        done.seconds,
    )
    return done


def _keep_shared(
    catalog: Catalog,
    store: BlobStore,
    run: str,
    x: CheckpointRecord,
    rows: list[ChunkInfo],
    policy: RerootPolicy,
) -> KeptChunks | None:
    """Where the shared chunks ``rows`` of the checkpoint ``x`` being deleted are kept: in
    its blob as it is, where they are all it holds; else copied, the rest left out, into a
    new blob (named on the garbage table before it is written, as a re-base's are): at most
    ``x``'s stored bytes are written, once; later deletes refer to that blob as it is."""
    if not rows:
        return None
    ids = frozenset(c.id for c in rows)
    size = sum(c.stored_len for c in rows)
    if x.blob_key and size == x.stored_bytes and all(c.blob_key == x.blob_key for c in rows):
        return KeptChunks(ids, x.blob_key, size)
    key = blob_key(run, x.step)
    due = datetime.now(UTC) + timedelta(seconds=policy.new_blob_due_s)
    new = NewBlobs(keys={x.blob_key: key}, garbage_ids=catalog.add_garbage(run, [key], due))
    try:
        rewrite_blob(store, rows, x.blob_key, Spools(Path()), new)
    except BaseException:
        drop_new_blobs(catalog, store, [key])
        raise
    return KeptChunks(ids, key, new.stored[x.blob_key], list(new.rows.values()), new.garbage_ids)


def _lock_run(held: ExitStack, catalog: Catalog, run: str) -> None:
    """Take ``run``'s re-root lock, then its lock, until ``held`` closes."""
    held.enter_context(catalog.reroot_lock(run))
    held.enter_context(catalog.run_lock(run))


def _lock_dependents(
    held: ExitStack, catalog: Catalog, run: str, find: Callable[[], list[ChunkInfo]]
) -> list[ChunkInfo]:
    """The chunks that rest on what is deleted (``find``), once the locks of every other run
    holding one (a fork of ``run``, or a fork of a fork) are held too (until ``held``
    closes): the re-base rewrites those runs' blobs, and a save to such a run may plan
    deltas of the deleted chunks. RunBusy if one of those runs has a checkpoint being
    written in parts. Forks are made after their source, so locks are always taken source
    first: no two deletes wait for each other."""
    taken = {run}
    while True:
        deps = find()
        ids = {d.checkpoint_id for d in deps}
        owners = catalog.records_by_id(ids, shared=True)
        if owners.keys() != ids:
            raise RunBusy(
                f"a checkpoint being written rests on run {run!r}'s checkpoints: retry once "
                "it is committed"
            )
        runs = {o.run for o in owners.values()} - taken
        if not runs:
            return deps
        for other in sorted(runs):
            _lock_run(held, catalog, other)
            _check_not_busy(catalog, other)
            taken.add(other)


def _rebase_and_commit(
    catalog: Catalog,
    store: BlobStore,
    run: str,
    gone: tuple[set[int], set[int]],
    deps: list[ChunkInfo],
    policy: RerootPolicy,
    scratch: Path,
    pool: Executor,
    commit: Callable[[RerootChanges, list[PartBlob]], None],
) -> tuple[int, NewBlobs, int]:
    """Re-base ``deps`` off the chunks going (``gone``: their ids, and their checkpoints'),
    write the new blobs, and ``commit`` the changes; a failure deletes what was written.
    Returns the chunks re-based, the new blobs and the bytes of the blobs they replace."""
    spools = Spools(scratch)
    registered: list[str] = []  # on the garbage table, written or not
    committed = False
    try:
        new, rebased = _rebase(catalog, store, run, gone[0], deps, spools, pool, policy)
        registered = list(new.keys.values())
        rebase, parts, replaced = _changes(catalog, gone[1], rebased, spools, new, policy.grace_s)
        commit(rebase, parts)
        committed = True
    finally:
        spools.close()
        if not committed:
            drop_new_blobs(catalog, store, registered)
    return len(spools.chunks), new, replaced


def _new_base(closure: dict[int, ChunkInfo], gone: set[int], d: ChunkInfo) -> ChunkInfo | None:
    """What ``d`` (whose base is a chunk of the deleted checkpoint, ids ``gone``) is
    re-encoded against: the first chunk on its base's chain that is not going, if it holds
    the same items; None (stored whole) where the chain ends first, or runs into a copy's
    fp32 master (another tensor)."""
    assert d.base_id is not None
    c = closure[d.base_id]
    while c.id in gone:
        if c.base_id is None or codec.split_cast(c.codec) is not None:
            return None
        c = closure[c.base_id]
    return c if (c.raw_len, c.itemsize) == (d.raw_len, d.itemsize) else None


def _rebase_chunk(
    decoder: ChainDecoder, d: ChunkInfo, base: ChunkInfo | None, level: int
) -> list[Rewrite]:
    """``d`` re-encoded against ``base`` (or whole, where that delta does not pay), checked."""
    raw = decoder.decode(d)
    base_raw = None if base is None else decoder.decode(base)
    enc = codec.encode_chunk(raw, base_raw, d.itemsize, level)
    if base_raw is not None and enc.codec != codec.REF and not codec.is_delta(enc.codec):
        base, base_raw = None, None  # whole: it must name no base
    checked(enc, base_raw, d)
    base_id = None if base is None else base.id
    return [Rewrite(d, enc.codec, base_id, 0, enc.parts)]  # depth: set at the commit


def _rebase(
    catalog: Catalog,
    store: BlobStore,
    run: str,
    gone: set[int],
    deps: list[ChunkInfo],
    spools: Spools,
    pool: Executor,
    policy: RerootPolicy,
) -> tuple[NewBlobs, dict[int, ChunkInfo]]:
    """Re-encode ``deps`` (the chunks resting on the chunks ``gone``, of ``run``) into
    ``spools`` and write the new blobs of the blobs holding them (of their own runs: forks
    too), named on the garbage table first. Returns them, and the rows the re-base read (the
    re-based chunks, their chains, their new bases)."""
    if not deps:
        return NewBlobs(keys={}, garbage_ids=[]), {}
    closure: dict[int, ChunkInfo] = {}
    for ck in sorted({d.checkpoint_id for d in deps}):
        closure.update(catalog.chunk_tree(ck)[1])
    decoder = ChainDecoder(store, closure, 2 * policy.bytes_in_flight)
    jobs = []
    # where a chain ends in the deleted checkpoint, the first chunk resting on it is stored
    # whole and the others rest on that one: a frozen tensor's refs stay refs
    holders: dict[int | None, ChunkInfo] = {}
    for d in deps:
        base = _new_base(closure, gone, d)
        if base is None:
            holder = holders.setdefault(d.base_id, d)
            base = None if holder is d else holder
        size = d.raw_len * (1 if base is None else 2)
        jobs.append((size, partial(_rebase_chunk, decoder, d, base, policy.zstd_level)))
    encode_all(jobs, spools, pool, None, policy.bytes_in_flight)
    owner = {d.blob_key: d.checkpoint_id for d in deps}
    info = catalog.records_by_id(set(owner.values()), shared=True)
    keys = {
        old: blob_key(info[owner[old]].run, info[owner[old]].step) for old in sorted(spools.files)
    }
    # Named before they exist: a crash from here on leaves only blobs the table names.
    # Due only after the time a crashed upload is given: the collector must not take a
    # blob this delete is about to commit (and the commit checks that it did not).
    due = datetime.now(UTC) + timedelta(seconds=policy.new_blob_due_s)
    new = NewBlobs(keys=keys, garbage_ids=catalog.add_garbage(run, keys.values(), due))
    for old in keys:
        rows = [c for c in catalog.chunks(owner[old]) if c.blob_key == old]
        rewrite_blob(store, rows, old, spools, new)
    return new, closure


def _depths(
    spools: Spools, rows: dict[int, ChunkInfo], below: dict[int, ChunkInfo]
) -> dict[int, int]:
    """The new depth of every re-based chunk and of every chunk whose chain goes through
    one (``below``): its base's depth, plus one unless it is a ref (a ref is its base).
    ``rows``: what the re-base read, the new bases included."""
    changed = {i: (s.codec, s.base_id) for i, s in spools.chunks.items()}
    depth: dict[int, int] = {}

    def of(i: int, seen: frozenset[int] = frozenset()) -> int:
        if i in depth:
            return depth[i]
        if i in seen:
            raise CorruptData(f"a delete's re-base would make chunk {i}'s chain a cycle")
        if i in changed:
            kind, base = changed[i]
        elif i in below:
            kind, base = below[i].codec, below[i].base_id
        else:  # a new base whose chain no re-base touched
            return rows[i].depth
        depth[i] = 0 if base is None else of(base, seen | {i}) + (kind != codec.REF)
        return depth[i]

    for i in (*changed, *below):
        of(i)
    return depth


def _changes(
    catalog: Catalog,
    gone: set[int],
    rows: dict[int, ChunkInfo],
    spools: Spools,
    new: NewBlobs,
    grace_s: float,
) -> tuple[RerootChanges, list[PartBlob], int]:
    """The re-base's changes (of the chunks resting on the checkpoints ``gone``), the parts'
    new blobs, and the bytes of the blobs it replaces."""
    below: dict[int, ChunkInfo] = {}
    if spools.chunks:
        found = catalog.descendants(spools.chunks.keys())
        below = {c.id: c for c in found if c.checkpoint_id not in gone}
    depth = _depths(spools, rows, below)
    affected = {c.checkpoint_id for c in below.values()}
    affected |= {rows[i].checkpoint_id for i in spools.chunks}
    by_id = catalog.records_by_id(affected, shared=True)
    updates = dict(new.rows)
    checkpoints: list[CheckpointUpdate] = []
    parts: list[PartBlob] = []
    replaced = 0
    for ck in sorted(affected):
        info = by_id[ck]
        own = catalog.part_blobs(ck)
        if own:  # written in parts: its chunks live in its parts' blobs
            stored = 0
            for p in own:
                if p.blob_key in new.keys:
                    replaced += p.stored_bytes
                    size = new.stored[p.blob_key]
                    parts.append(replace(p, new_blob_key=new.keys[p.blob_key], stored_bytes=size))
                stored += new.stored.get(p.blob_key, p.stored_bytes)
            old = key = info.blob_key
        else:
            old = info.blob_key
            key = new.keys.get(old, old)
            stored = new.stored.get(old, info.stored_bytes)
            replaced += info.stored_bytes if old in new.keys else 0
        checkpoints.append(checkpoint_figures(catalog, ck, depth, updates, old, key, stored))
    rebase = RerootChanges(
        chunks=list(updates.values()),
        checkpoints=checkpoints,
        written=new.garbage_ids,
        retired=list(new.keys),
        not_before=datetime.now(UTC) + timedelta(seconds=grace_s),
    )
    return rebase, parts, replaced


def delete_run(
    catalog: Catalog,
    store: BlobStore,
    run: str,
    policy: RerootPolicy,
    *,
    scratch: Path,
    pool: Executor,
) -> int:
    """Delete every checkpoint of ``run``: their blobs (their own, their parts') go on the
    garbage table due after the grace time, their rows go (the checkpoints' own stay as
    tombstones). Chunks of other runs that rest on the run's (forks of it) are re-based
    first, as a delete of one checkpoint re-bases (the first resting on a chunk stored
    whole, the others on it), under those runs' locks too, and committed in the same
    transaction. Returns how many went; RunNotFound if none, CheckpointPinned if one is
    pinned, RunBusy while the run (or a fork of it) has a checkpoint being written in
    parts. Under the run's re-root lock and its lock."""
    with ExitStack() as held:
        _lock_run(held, catalog, run)
        _check_not_busy(catalog, run)
        infos = catalog.list_checkpoints(run)
        pinned = [i.step for i in infos if i.pinned]
        if pinned:
            raise pinned_refusal(run, pinned)
        deps = _lock_dependents(held, catalog, run, partial(catalog.run_dependents, run))
        due = datetime.now(UTC) + timedelta(seconds=policy.grace_s)
        if not deps:
            count, blobs = catalog.delete_run(run, due)
        else:
            ids = {i.id for i in infos}
            # the shared chunks its deleted checkpoints keep go too
            gone = {c.id for i in ids | catalog.sharing(run) for c in catalog.chunks(i)}
            out: list[tuple[int, list[str]]] = []

            def commit(rebase: RerootChanges, parts: list[PartBlob]) -> None:
                out.append(catalog.delete_run(run, due, rebase, parts))

            _rebase_and_commit(
                catalog, store, run, (gone, ids), deps, policy, scratch, pool, commit
            )
            count, blobs = out[0]
    log.info("deleted run %s: %d checkpoints, %d blobs to collect", run, count, len(blobs))
    return count
