"""Archival: moving a run's old checkpoints to the lossy tier, in the background (issue 23,
docs/lossy.md#archival).

A run's retention policy may say ``lossy_after=K`` (:mod:`ckptstore_core.retention`): every
checkpoint older than the newest K, not pinned, becomes lossy. After each save of the run
(and when a policy is set, and at each sweep for what a restart left undone)
:class:`.scheduler.Maintenance` calls :func:`apply_archival`, which converts them one at a
time, oldest first (:func:`archive_checkpoint`). Converting checkpoint X:

* X's paired fp32 tensors (:func:`ckptstore_core.lossy.pair_tensors` on its tensors and its
  stored skeleton) are re-encoded chunk by chunk with :func:`ckptstore_core.lossy.encode`
  against the same chunk of X's parent *as it loads* (its reconstruction, decoded along its
  chain: the parent was usually converted just before), ``v_prev`` being the parent's
  ``exp_avg_sq`` at the same elements. A lossy chunk is a ``lossy/1`` link on the parent's
  chunk, and its checksum is its reconstruction's. Chunks the encoder leaves lossless
  (exact moments, small or non-finite chunks, no parent), and every other tensor, stay as
  they are. A chunk whose chain would get deeper than ``lossy_max_depth`` stays too (so a
  long lossy segment holds a lossless chunk every ``lossy_max_depth`` checkpoints or so).
* Every chunk resting on a chunk whose bytes changed (a later checkpoint's delta or ref, a
  bf16 copy predicted from it) is re-encoded losslessly against the new reconstruction:
  its own bytes never change, and each new encoding is decoded back against its checksum
  (:func:`.rewrite.checked`). It is stored whole instead where the delta would make its
  chain deeper than it was (lossless chains never get deeper), where it is a bf16/f16 copy,
  or where it lies on the chain of a base the conversion read (a re-root may have reversed
  chains: this could loop).
* The new encodings are checked, spooled, the new blobs named on the garbage table, then
  written; one transaction (:meth:`Catalog.commit_archive`) swaps the rows, sets the new
  checksums (chunks and tensors; a tensor keeps the checksum it was sent with for an
  idempotent retry of its save) and marks X lossy with its parameters. The replaced blobs
  are collected after ``garbage_grace_s``. A crash before the commit leaves X as it was
  and the new blobs on the garbage table; after it, X is lossy and the old blobs wait on
  the table. Either way X loads (to its old bytes, or to its reconstruction) and verifies,
  and the next collection leaves exactly what the catalog names.

What keeps it safe besides: each conversion holds the run's re-root lock and its lock
(taken in short tries, so a shutdown never waits on a long save), re-decides under them
(a pin, a save, a policy change since the pass began count), and its commit refuses a
checkpoint pinned meanwhile. A run with a checkpoint being written in parts is left for a
later pass (its parts may rest on X's chunks unseen). Checkpoints written in parts, and
checkpoints whose changed chunks another run's chunks rest on (a fork's), are not
converted (their blobs are not this run's to rewrite). Pinned checkpoints, the newest K,
and whatever the encoder leaves lossless stay bit-exact.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

import numpy as np
import xxhash

from ckptstore_core import codec, lossy
from ckptstore_core.errors import CheckpointNotFound, CheckpointPinned, RunBusy, RunNotFound
from ckptstore_core.records import PARAM_NAMES_KEY
from ckptstore_core.retention import Candidate, RetentionPolicy, lossy_steps
from ckptstore_service.catalog import Catalog, CheckpointRecord, ChunkInfo, TensorInfo
from ckptstore_service.catalog.archive import ArchiveChanges
from ckptstore_service.catalog.garbage import RerootChanges
from ckptstore_service.chains import ChainDecoder, Piece
from ckptstore_service.maintenance.reroot import RerootPolicy
from ckptstore_service.maintenance.retention import effective_policy
from ckptstore_service.maintenance.rewrite import (
    NewBlobs,
    Rewrite,
    Spools,
    Stopped,
    checked,
    checkpoint_figures,
    drop_new_blobs,
    new_depths,
    polled,
    rewrite_blob,
    run_bounded,
)
from ckptstore_service.names import blob_key
from ckptstore_service.storage import BlobStore

__all__ = [
    "PAUSE_ENV",
    "Archived",
    "apply_archival",
    "archive_candidates",
    "archive_checkpoint",
    "runs_to_archive",
]

log = logging.getLogger("ckptstore")

#: Tests only: seconds an archival waits once its new blobs are written, before its commit
#: (a SIGKILL lands there: tests/integration/test_lossy_archive.py).
PAUSE_ENV = "CKPTSTORE_TEST_ARCHIVE_PAUSE_S"


class _Skip(Exception):
    """The checkpoint is not (any more) one to convert: decided under the run's locks."""


@dataclass(frozen=True, slots=True)
class Archived:
    """What one conversion did: the checkpoint (as it was), its chunks made lossy, the
    chunks of it and of other checkpoints re-encoded losslessly on them, the stored bytes
    of the blobs it replaced and of those written in their place."""

    checkpoint: CheckpointRecord
    lossy_chunks: int
    rebased_chunks: int
    bytes_replaced: int
    bytes_written: int
    seconds: float


def archive_candidates(
    policy: RetentionPolicy | None, infos: list[CheckpointRecord]
) -> list[CheckpointRecord]:
    """The checkpoints of ``infos`` (a run's committed ones) that ``policy`` moves to the
    lossy tier and that are not there yet, oldest first: older than the newest
    ``lossy_after``, not pinned, not lossy, written in one part, and not the run's first
    (a lossy chunk is a link on its parent's same chunk: the first has nothing to rest on)."""
    steps = lossy_steps(policy, [Candidate(i.step, i.pinned, i.metadata) for i in infos])
    first = min((i.step for i in infos), default=None)
    chosen = [
        i for i in infos if i.step in steps and i.step != first and i.lossy is None and i.parts == 1
    ]
    return sorted(chosen, key=lambda i: i.step)


def runs_to_archive(catalog: Catalog, default: RetentionPolicy | None) -> list[str]:
    """The runs with a checkpoint their policy (their own, else ``default``) moves to the
    lossy tier and that is not there yet: what a sweep queues (a restart may have cut a
    pass short)."""
    out = []
    for run in catalog.list_runs():
        policy = effective_policy(catalog, run.name, default)
        if policy is None or not policy.archives:
            continue
        with contextlib.suppress(RunNotFound):
            if archive_candidates(policy, catalog.list_checkpoints(run.name)):
                out.append(run.name)
    return out


def apply_archival(
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
    """Convert the checkpoints of ``run`` that its policy (its own, else ``default``) moves
    to the lossy tier, oldest first; returns the steps converted. A checkpoint that is not
    one to convert any more (gone, pinned, kept exact after all) or that cannot be (a fork
    rests on it) is skipped; a run with a checkpoint being written in parts is left for a
    later pass. Stops between conversions once ``stop`` is set (one in progress is
    abandoned: :class:`.rewrite.Stopped`)."""
    retention = effective_policy(catalog, run, default)
    if retention is None or not retention.archives:
        return []
    try:
        todo = archive_candidates(retention, catalog.list_checkpoints(run))
    except RunNotFound:
        return []
    done: list[int] = []
    for x in todo:
        if stop is not None and stop.is_set():
            break
        try:
            archive_checkpoint(
                catalog, store, run, x.step, policy, default, scratch=scratch, pool=pool, stop=stop
            )
        except (_Skip, CheckpointNotFound, CheckpointPinned):
            continue
        except (RunBusy, RunNotFound) as exc:
            log.info("archival of %s stopped: %s", run, exc)
            break
        done.append(x.step)
    return done


def archive_checkpoint(
    catalog: Catalog,
    store: BlobStore,
    run: str,
    step: int,
    policy: RerootPolicy,
    default: RetentionPolicy | None,
    *,
    scratch: Path,
    pool: Executor,
    stop: threading.Event | None = None,
) -> Archived:
    """Convert checkpoint ``step`` of ``run`` to the lossy tier (the module's docstring says
    how), under the run's re-root lock and its lock; returns what it did. Raises _Skip when
    it is not one to convert (decided again under the locks), CheckpointNotFound /
    CheckpointPinned when it went or was pinned (the commit checks), RunBusy while the run
    has a checkpoint being written in parts, Stopped once ``stop`` is set. A conversion
    that fails changes no row and deletes what it wrote."""
    t0 = time.perf_counter()
    with ExitStack() as held:
        held.enter_context(polled(partial(catalog.reroot_lock, run, blocking=False), stop))
        held.enter_context(polled(partial(catalog.run_lock, run, blocking=False), stop))
        retention = effective_policy(catalog, run, default)
        infos = catalog.list_checkpoints(run)
        x = next((i for i in infos if i.step == step), None)
        if x is None:
            raise CheckpointNotFound(f"run {run!r} has no checkpoint at step {step}")
        if retention is None or x.id not in {i.id for i in archive_candidates(retention, infos)}:
            raise _Skip
        busy = catalog.open_parts_step(run)
        if busy is not None:
            raise RunBusy(f"run {run!r} has a checkpoint being written in parts (step {busy})")
        parent = max((i for i in infos if i.step < step), key=lambda i: i.step, default=None)
        work = _Conversion(catalog, store, run, x, parent, retention.lossy_params(), policy)
        return work.run(scratch, pool, stop, t0)


def _f32(data: Piece) -> np.ndarray:
    return np.frombuffer(data, np.float32)


@dataclass
class _Target:
    """One chunk of X to encode lossy: its role, its base (the parent's same chunk) if
    one may be used, the parent's ``exp_avg_sq`` chunk at the same elements."""

    chunk: ChunkInfo
    role: lossy.Role
    base: ChunkInfo
    v_prev: ChunkInfo | None


@dataclass
class _Done:
    """What one job did: the rewrites, and the bytes the chunk loads to from the commit on
    (for its tensor's checksum), if it belongs to a lossy tensor."""

    rewrites: list[Rewrite]
    tensor_idx: int
    data: Piece


class _Conversion:
    """The conversion of one checkpoint X, from its plan to its commit."""

    def __init__(
        self,
        catalog: Catalog,
        store: BlobStore,
        run: str,
        x: CheckpointRecord,
        parent: CheckpointRecord | None,
        params: lossy.Lossy,
        policy: RerootPolicy,
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.run_name = run
        self.x = x
        self.parent = parent
        self.params = params
        self.pairing: dict[str, object] | None = None  # what _targets paired
        self.policy = policy

    def run(
        self, scratch: Path, pool: Executor, stop: threading.Event | None, t0: float
    ) -> Archived:
        catalog, x = self.catalog, self.x
        tensors = catalog.tensors(x.id)
        own, closure = catalog.chunk_tree(x.id)
        parent_ids: set[int] = set()
        if self.parent is not None:
            _, parent_closure = catalog.chunk_tree(self.parent.id)
            parent_ids = set(parent_closure)
            closure.update(parent_closure)
        targets = self._targets(tensors, own, closure)
        ids = {t.chunk.id for t in targets}
        deps = [c for c in own if c.base_id in ids and c.id not in ids]
        deps += catalog.dependents(x.id)
        deps = [d for d in deps if d.base_id in ids and d.id not in ids]
        self._check_dependents(deps)
        for ck in sorted({d.checkpoint_id for d in deps} - {x.id}):
            closure.update(catalog.chunk_tree(ck)[1])
        decoder = ChainDecoder(self.store, closure, 2 * self.policy.bytes_in_flight)
        by_base: dict[int, list[ChunkInfo]] = {}
        for d in deps:
            assert d.base_id is not None
            by_base.setdefault(d.base_id, []).append(d)
        # in X's chunk order, to hash its lossy tensors' new bytes as they come: the
        # chunks to encode, and the other chunks of those tensors as they are
        lossy_tensors = {t.chunk.tensor_idx for t in targets}
        by_id = {t.chunk.id: t for t in targets}
        jobs: list[tuple[int, Callable[[], _Done]]] = []
        for c in own:
            t = by_id.get(c.id)
            if t is not None:
                mine = by_base.get(c.id, [])
                size = c.raw_len * (4 + len(mine))
                jobs.append((size, partial(self._encode, decoder, t, mine, parent_ids)))
            elif c.tensor_idx in lossy_tensors:
                jobs.append((c.raw_len, partial(self._as_is, decoder, c)))
        spools = Spools(scratch)
        registered: list[str] = []
        committed = False
        try:
            sums = _run_jobs(jobs, spools, pool, stop, self.policy.bytes_in_flight, tensors)
            lossy_count = sum(
                1 for i, s in spools.chunks.items() if s.codec == lossy.LOSSY and i in ids
            )
            new, replaced = self._write(spools, stop)
            registered = list(new.keys.values())
            pause = float(os.environ.get(PAUSE_ENV, "0") or 0)
            if pause > 0 and stop is not None and stop.wait(pause):
                raise Stopped
            self._commit(spools, new, sums)
            committed = True
        finally:
            spools.close()
            if not committed:
                drop_new_blobs(catalog, self.store, registered)
        done = Archived(
            checkpoint=x,
            lossy_chunks=lossy_count,
            rebased_chunks=len(spools.chunks) - lossy_count,
            bytes_replaced=replaced,
            bytes_written=sum(new.stored.values()),
            seconds=time.perf_counter() - t0,
        )
        log.info(
            "archived %s/%d lossy: %d chunks lossy, %d re-based, %d -> %d stored bytes in "
            "%d blobs, in %.2fs",
            self.run_name,
            x.step,
            done.lossy_chunks,
            done.rebased_chunks,
            done.bytes_replaced,
            done.bytes_written,
            len(new.keys),
            done.seconds,
        )
        return done

    # -- the plan ---------------------------------------------------------------------------

    def _targets(
        self, tensors: list[TensorInfo], own: list[ChunkInfo], closure: dict[int, ChunkInfo]
    ) -> list[_Target]:
        """X's chunks to encode lossy: those of its paired fp32 tensors (not refs within X,
        whose base changes with them) that have a base: the parent's same chunk (same
        tensor, shape and elements), if the chain would not get deeper than
        ``lossy_max_depth`` (a lossy link needs its base)."""
        skeleton = json.loads(self.x.stored_metadata.get("skeleton", "null"))
        specs = [(t.name, t.dtype, t.shape) for t in tensors]
        roles: dict[str, tuple[lossy.Role, str | None]] = {}
        names = self.x.stored_metadata.get(PARAM_NAMES_KEY)
        pairing = lossy.pairing(specs, skeleton, names)
        self.pairing = pairing.summary()
        for p in pairing.pairs:
            roles[p.weight] = ("weight", p.exp_avg_sq)
            if p.exp_avg is not None:
                roles[p.exp_avg] = ("exp_avg", p.exp_avg_sq)
            if p.exp_avg_sq is not None:
                roles[p.exp_avg_sq] = ("exp_avg_sq", p.exp_avg_sq)
        by_idx = {t.idx: t for t in tensors}
        parent_chunks = self._parent_chunks()
        mine = {c.id for c in own}
        out = []
        for c in own:
            t = by_idx[c.tensor_idx]
            if t.name not in roles or t.dtype != "F32" or c.itemsize != 4:
                continue
            if c.codec == codec.REF and c.base_id in mine:
                continue  # a tie within X: it follows its base (re-encoded with it)
            role, v_name = roles[t.name]
            base = parent_chunks.get((t.name, t.shape, c.offset, c.raw_len))
            if base is None or base.depth + 1 > self.policy.lossy_max_depth:
                continue  # a lossy chunk is a link on its parent's: none, or too deep
            # the parent's exp_avg_sq of the pair: same shape as its weight, same elements
            v_prev = (
                None
                if v_name is None
                else parent_chunks.get((v_name, t.shape, c.offset, c.raw_len))
            )
            out.append(_Target(c, role, base, v_prev))
        return out

    def _parent_chunks(self) -> dict[tuple[str, tuple[int, ...], int, int], ChunkInfo]:
        """The parent's fp32 chunks by (tensor name, shape, offset, length)."""
        if self.parent is None:
            return {}
        tensors = {t.idx: t for t in self.catalog.tensors(self.parent.id) if t.dtype == "F32"}
        out = {}
        for c in self.catalog.chunks(self.parent.id):
            t = tensors.get(c.tensor_idx)
            if t is not None:
                out[(t.name, t.shape, c.offset, c.raw_len)] = c
        return out

    def _check_dependents(self, deps: list[ChunkInfo]) -> None:
        """_Skip if a chunk to re-base is another run's (a fork's) or a checkpoint's
        written in parts: their blobs are not this conversion's to rewrite."""
        others = {d.checkpoint_id for d in deps} - {self.x.id}
        if not others:
            return
        records = self.catalog.records_by_id(others)
        if records.keys() != others or any(
            r.run != self.run_name or r.parts > 1 for r in records.values()
        ):
            log.info(
                "not archiving %s/%d: a fork or a checkpoint written in parts rests on it",
                self.run_name,
                self.x.step,
            )
            raise _Skip

    # -- the encodings (in the pool) --------------------------------------------------------

    def _as_is(self, decoder: ChainDecoder, c: ChunkInfo) -> _Done:
        return _Done([], c.tensor_idx, decoder.decode(c))

    def _encode(
        self,
        decoder: ChainDecoder,
        t: _Target,
        deps: list[ChunkInfo],
        parent_ids: set[int],
    ) -> _Done:
        """Chunk ``t`` encoded lossy (or left as it is), and the chunks resting on it
        re-encoded on its reconstruction where its bytes changed."""
        c = t.chunk
        raw = decoder.decode(c)
        base = decoder.decode(t.base)
        v_prev = None
        if t.v_prev is not None:
            v_prev = base if t.v_prev.id == t.base.id else decoder.decode(t.v_prev)
        out = lossy.encode(
            t.role,
            _f32(raw),
            _f32(base),
            None if v_prev is None else _f32(v_prev),
            self.params,
        )
        if out is None:
            return _Done([], c.tensor_idx, raw)
        payload, recon = out
        data = recon.view(np.uint8).data
        digest = codec.checksum(data)
        depth = t.base.depth + 1
        if digest == c.checksum and (c.codec == codec.REF or depth > c.depth):
            return _Done([], c.tensor_idx, raw)  # same bytes: a ref, or shallower as it is
        enc = codec.EncodedChunk(lossy.LOSSY, (payload,), digest)
        checked(enc, base, c, expected=digest)
        rewrites = [Rewrite(c, lossy.LOSSY, t.base.id, depth, (payload,), digest)]
        if digest != c.checksum:
            rewrites += [_rebase(decoder, d, c, data, depth, parent_ids, self.policy) for d in deps]
        return _Done(rewrites, c.tensor_idx, data)

    # -- writing and committing ------------------------------------------------------------

    def _write(self, spools: Spools, stop: threading.Event | None) -> tuple[NewBlobs, int]:
        """The new blobs (one per blob holding a rewritten chunk), named on the garbage
        table before they are written; and the stored bytes of the blobs they replace."""
        catalog = self.catalog
        infos = catalog.list_checkpoints(self.run_name)
        owner = {i.blob_key: i for i in infos if i.blob_key in spools.files}
        keys = {old: blob_key(owner[old].run, owner[old].step) for old in sorted(spools.files)}
        # due only after the time a crashed upload is given: no collector takes them first
        due = datetime.now(UTC) + timedelta(seconds=self.policy.new_blob_due_s)
        new = NewBlobs(
            keys=keys, garbage_ids=catalog.add_garbage(self.run_name, keys.values(), due)
        )
        for old in keys:
            if stop is not None and stop.is_set():
                raise Stopped
            rewrite_blob(self.store, catalog.chunks(owner[old].id), old, spools, new)
        return new, sum(owner[old].stored_bytes for old in keys)

    def _commit(self, spools: Spools, new: NewBlobs, sums: dict[int, bytes]) -> None:
        """The depths of everything whose chain goes through a rewritten chunk, each
        affected checkpoint's figures, then one transaction."""
        catalog = self.catalog
        depth, below = new_depths(catalog, {i: s.depth for i, s in spools.chunks.items()})
        infos = {i.id: i for i in catalog.list_checkpoints(self.run_name)}
        owners = {i.blob_key: i.id for i in infos.values() if i.blob_key in new.keys}
        updates = dict(new.rows)
        checkpoints = []
        for ck in sorted(set(owners.values()) | {c.checkpoint_id for c in below}):
            info = infos[ck]
            old = info.blob_key
            checkpoints.append(
                checkpoint_figures(
                    catalog,
                    ck,
                    depth,
                    updates,
                    old_blob_key=old,
                    blob_key=new.keys.get(old, old),
                    stored_bytes=new.stored.get(old, info.stored_bytes),
                )
            )
        changed = [(idx, digest) for idx, digest in sorted(sums.items())]
        rewrite = RerootChanges(
            chunks=list(updates.values()),
            checkpoints=checkpoints,
            written=new.garbage_ids,
            retired=list(new.keys),
            not_before=datetime.now(UTC) + timedelta(seconds=self.policy.grace_s),
        )
        params = json.dumps(self.params.to_json(), separators=(",", ":"))
        pairing = None if self.pairing is None else json.dumps(self.pairing)
        catalog.commit_archive(
            self.run_name, ArchiveChanges(self.x.id, params, changed, rewrite, pairing)
        )


def _rebase(
    decoder: ChainDecoder,
    d: ChunkInfo,
    base: ChunkInfo,
    base_data: Piece,
    base_depth: int,
    parent_ids: set[int],
    policy: RerootPolicy,
) -> Rewrite:
    """``d`` (resting on ``base``, whose bytes become ``base_data`` at depth
    ``base_depth``) re-encoded losslessly: a delta or ref of ``base_data`` where that keeps
    its chain as deep as it was at most, else whole; checked against its own checksum."""
    raw = decoder.decode(d)
    whole = (
        codec.split_cast(d.codec) is not None  # a bf16/f16 copy: another dtype than its base
        or (d.raw_len, d.itemsize) != (base.raw_len, base.itemsize)
        or d.id in parent_ids  # on the chain the conversion read: it could loop
    )
    if not whole:
        enc = codec.encode_chunk(raw, base_data, d.itemsize, policy.zstd_level)
        new_depth = base_depth + (enc.codec != codec.REF)
        if enc.codec == codec.REF or (codec.is_delta(enc.codec) and new_depth <= d.depth):
            checked(enc, base_data, d)
            return Rewrite(d, enc.codec, base.id, new_depth, enc.parts)
    enc = checked(codec.encode_chunk(raw, None, d.itemsize, policy.zstd_level), None, d)
    return Rewrite(d, enc.codec, None, 0, enc.parts)


def _run_jobs(
    jobs: list[tuple[int, Callable[[], _Done]]],
    spools: Spools,
    pool: Executor,
    stop: threading.Event | None,
    bytes_in_flight: int,
    tensors: list[TensorInfo],
) -> dict[int, bytes]:
    """Run ``jobs`` (in X's chunk order) in ``pool``, as many at a time as fit
    ``bytes_in_flight``, spooling their rewrites and hashing, in order, the bytes of the
    tensors they cover; returns the new checksum of each tensor whose bytes changed.
    ``stop`` abandons the work between two jobs."""
    hashers: dict[int, xxhash.xxh3_128] = {}

    def take(done: _Done) -> None:
        for r in done.rewrites:
            spools.add(r)
        hashers.setdefault(done.tensor_idx, xxhash.xxh3_128()).update(done.data)

    run_bounded(jobs, take, pool, stop, bytes_in_flight)
    by_idx = {t.idx: t for t in tensors}
    out = {}
    for idx, h in hashers.items():
        digest = h.digest()
        if digest != by_idx[idx].checksum:
            out[idx] = digest
    return out
