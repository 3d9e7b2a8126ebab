"""Re-rooting a run's chain after the fact, and collecting the blobs it replaces.

Each link of a delta chain costs every load that goes through it (measured: ~16 ms per link,
end to end, on a 117 MB state). A save can only be a forward delta (the new checkpoint is all
it has), so the newest checkpoint of a segment is the deepest one. Once a save leaves it
``reroot_depth`` deltas deep, the service moves the segment's self-contained root to the
segment's middle checkpoint M, in the background: each chunk of M is stored whole, and the
chunks on its chain back to the old root become deltas the other way round, each of its
successor. Every delta still spans one checkpoint, so the bytes barely change (+0.4% on the
fine-tune bench, see ``bench/chains.py``), and both ends of the segment are half as deep.

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
* It runs under the run's lock, so no save of the run interleaves; it takes the lock without
  waiting, and a save that holds it triggers a pass of its own when it ends.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import IO, Any

from ckptstore import codec
from ckptstore.errors import CorruptData, RunNotFound, StorageUnavailable
from ckptstore_service.catalog import CheckpointInfo, ChunkInfo
from ckptstore_service.restore import ChainDecoder, Piece, WindowReader
from ckptstore_service.runtime import Runtime
from ckptstore_service.storage import Buffer

__all__ = ["Maintenance", "collect_garbage", "reroot", "reroot_target"]

log = logging.getLogger("ckptstore")


def reroot_target(rt: Runtime, run: str) -> tuple[CheckpointInfo, list[CheckpointInfo]] | None:
    """Where to re-root the run's newest segment, and the run's checkpoints; None unless the
    newest checkpoint is ``reroot_depth`` deep.

    The new root is halfway from the segment's current root (its shallowest checkpoint) to
    the newest one: the newest becomes half as deep, and the checkpoints before the old root
    deeper. Once in a segment (the bench: 9 checkpoints, the root moves from the first to the
    fifth) both ends end up half as deep; a segment much longer than ``reroot_depth`` is
    re-rooted again every ``reroot_depth / 2`` saves, and its oldest checkpoints, the ones
    least often loaded, get deeper, up to ``max_chain_depth`` as without re-rooting."""
    depth = rt.settings.reroot_depth
    if not depth:
        return None
    try:
        infos = rt.catalog.list_checkpoints(run)
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
    # no further from the oldest checkpoint than max_chain_depth: it will be that deep
    target = max((root + 1) // 2, len(segment) - 1 - rt.settings.max_chain_depth)
    return (segment[target], infos) if 0 < target < root else None


@dataclass(frozen=True, slots=True)
class _Rewrite:
    chunk: ChunkInfo  # the row as it was
    codec: str
    base_id: int | None
    depth: int
    parts: tuple[Buffer, ...]


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


def _checked(enc: codec.EncodedChunk, base: Piece | None, c: ChunkInfo) -> codec.EncodedChunk:
    """``enc`` once it has decoded back to ``c``'s bytes."""
    links: list[tuple[str, Buffer]] = [(enc.codec, enc.payload)]
    if base is not None:
        links.insert(0, (codec.RAW, base))
    codec.decode_chain(links, c.itemsize, c.raw_len, c.checksum)
    return enc


def _reverse(decoder: ChainDecoder, path: list[ChunkInfo], level: int) -> list[_Rewrite]:
    """Re-encode one chain: its top stored whole, every other link a delta of its successor
    (or whole, where that delta does not pay)."""
    raws = [decoder.decode(path[0])]
    for p in path[1:]:
        links = [(codec.RAW, raws[-1]), (p.codec, decoder.fetch(p))]
        raws.append(codec.decode_chain(links, p.itemsize, p.raw_len, p.checksum))
    top = path[-1]
    enc = _checked(codec.encode_chunk(raws[-1], None, top.itemsize, level), None, top)
    out = [_Rewrite(top, enc.codec, None, 0, enc.parts)]
    depth = 0
    for j in range(len(path) - 2, -1, -1):
        p = path[j]
        base: Piece | None = raws[j + 1]
        enc = codec.encode_chunk(raws[j], base, p.itemsize, level)
        if not codec.is_delta(enc.codec):  # whole (a ref cannot be: it would have been one)
            enc, base = codec.encode_chunk(raws[j], None, p.itemsize, level), None
        _checked(enc, base, p)
        depth = 0 if base is None else depth + 1
        out.append(
            _Rewrite(p, enc.codec, None if base is None else path[j + 1].id, depth, enc.parts)
        )
    return out


@dataclass(frozen=True, slots=True)
class _Spooled:
    codec: str
    base_id: int | None
    depth: int
    offset: int  # in its checkpoint's spool file
    size: int


class _Spools:
    """The new encodings of each checkpoint, in an unnamed temp file of its own until its
    new blob is written: memory holds only the chains being re-encoded."""

    def __init__(self, folder: os.PathLike[str]) -> None:
        self._folder = folder
        self.files: dict[int, IO[bytes]] = {}
        self.chunks: dict[int, _Spooled] = {}

    def add(self, r: _Rewrite) -> None:
        f = self.files.get(r.chunk.checkpoint_id)
        if f is None:
            # closed by close(): one per rewritten checkpoint, open across many calls
            f = tempfile.TemporaryFile(dir=self._folder)  # noqa: SIM115
            self.files[r.chunk.checkpoint_id] = f
        offset = f.seek(0, os.SEEK_END)
        size = 0
        for part in r.parts:
            size += f.write(part)
        self.chunks[r.chunk.id] = _Spooled(r.codec, r.base_id, r.depth, offset, size)

    def read(self, checkpoint_id: int, s: _Spooled) -> bytes:
        f = self.files[checkpoint_id]
        f.flush()
        data = os.pread(f.fileno(), s.size, s.offset)
        if len(data) != s.size:
            raise OSError("a re-root's spool file is shorter than what it wrote")
        return data

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _encode_all(
    rt: Runtime, decoder: ChainDecoder, paths: list[list[ChunkInfo]], spools: _Spools
) -> None:
    """Re-encode the chains in the codec pool, a few at a time (each holds its raw links)."""
    pending: deque[Future[list[_Rewrite]]] = deque()
    try:
        for path in paths:
            pending.append(rt.pool.submit(_reverse, decoder, path, rt.settings.zstd_level))
            while len(pending) > rt.workers:
                for r in pending.popleft().result():
                    spools.add(r)
        while pending:
            for r in pending.popleft().result():
                spools.add(r)
    finally:
        for fut in pending:
            fut.cancel()


def _new_depths(
    rt: Runtime, rewritten: dict[int, _Spooled]
) -> tuple[dict[int, int], list[ChunkInfo]]:
    """The depth of every chunk whose chain goes through a rewritten one, and those chunks."""
    depth = {i: s.depth for i, s in rewritten.items()}
    below = rt.catalog.descendants(depth.keys())
    by_id = {c.id: c for c in below}
    for c in below:
        stack = []
        while c.id not in depth:
            stack.append(c)
            if c.base_id in depth:
                break
            if c.base_id not in by_id:
                raise CorruptData(f"the catalog's chunk {c.id} lost its base during a re-root")
            c = by_id[c.base_id]
        for x in reversed(stack):
            assert x.base_id is not None
            depth[x.id] = depth[x.base_id] + (x.codec != codec.REF)
    return depth, below


def reroot(rt: Runtime, run: str) -> bool:
    """Re-root the run's newest segment at its middle if its newest checkpoint is
    ``reroot_depth`` deep. The caller holds the run's lock. Returns whether it did."""
    found = reroot_target(rt, run)
    if found is None:
        return False
    target, infos = found
    t0 = time.perf_counter()
    tops, closure = rt.catalog.chunk_tree(target.id)
    decoder = ChainDecoder(rt, closure)
    paths = _paths(decoder, tops)
    if not paths:
        return False
    spools = _Spools(rt.cache.folder / "tmp")
    written: list[str] = []
    try:
        _encode_all(rt, decoder, paths, spools)
        depth, below = _new_depths(rt, spools.chunks)
        info_of = {i.id: i for i in infos}
        owners = sorted(spools.files)
        new_keys = {ck: f"runs/{run}/{info_of[ck].step}-{uuid.uuid4().hex}.blob" for ck in owners}
        # named before they exist: a crash from here on leaves only blobs the table names
        rt.catalog.add_garbage(run, new_keys.values(), datetime.now(UTC))
        updates: dict[int, dict[str, Any]] = {}
        checkpoints = []
        for ck in sorted(set(owners) | {c.checkpoint_id for c in below}):
            rows = rt.catalog.chunks(ck)
            stored = info_of[ck].stored_bytes
            if ck in spools.files:
                stored = _rewrite_blob(rt, ck, rows, spools, new_keys[ck], updates)
                written.append(new_keys[ck])
            chain_depth = max((depth.get(c.id, c.depth) for c in rows), default=0)
            checkpoints.append(
                {
                    "id": ck,
                    "old_blob_key": info_of[ck].blob_key,
                    "blob_key": new_keys.get(ck, info_of[ck].blob_key),
                    "stored_bytes": stored,
                    "chain_depth": chain_depth,
                    "keyframe": chain_depth == 0,
                }
            )
            for c in rows:
                if c.id in updates:
                    updates[c.id]["depth"] = depth.get(c.id, c.depth)
                elif depth.get(c.id, c.depth) != c.depth:
                    updates[c.id] = _row(c, depth=depth[c.id])
        rt.catalog.commit_reroot(
            run,
            chunks=list(updates.values()),
            checkpoints=checkpoints,
            written=written,
            retired=[info_of[ck].blob_key for ck in owners],
            not_before=datetime.now(UTC) + timedelta(seconds=rt.settings.garbage_grace_s),
        )
    finally:
        spools.close()
    log.info(
        "re-rooted %s at step %d: %d chains, %d checkpoints rewritten, in %.2fs",
        run,
        target.step,
        len(paths),
        len(written),
        time.perf_counter() - t0,
    )
    return True


def _row(c: ChunkInfo, **changes: Any) -> dict[str, Any]:
    row = {
        "id": c.id,
        "codec": c.codec,
        "base_id": c.base_id,
        "depth": c.depth,
        "blob_offset": c.blob_offset,
        "stored_len": c.stored_len,
    }
    row.update(changes)
    return row


def _rewrite_blob(
    rt: Runtime,
    checkpoint_id: int,
    rows: list[ChunkInfo],
    spools: _Spools,
    key: str,
    updates: dict[int, dict[str, Any]],
) -> int:
    """Write checkpoint ``checkpoint_id``'s new blob (its rewritten chunks from the spool,
    the others copied from its old blob); record every row's new place in ``updates``."""
    reader = WindowReader(rt.store, rows)

    def pieces() -> Iterator[Buffer]:
        offset = 0
        for c in rows:
            new = spools.chunks.get(c.id)
            if new is None:
                data: Buffer = reader.get(c.blob_key, c.blob_offset, c.blob_offset + c.stored_len)
                row = _row(c, blob_offset=offset)
            else:
                data = spools.read(checkpoint_id, new)
                row = _row(
                    c,
                    codec=new.codec,
                    base_id=new.base_id,
                    depth=new.depth,
                    blob_offset=offset,
                    stored_len=new.size,
                )
            updates[c.id] = row
            offset += len(data)
            if len(data):
                yield data

    return rt.store.put_stream(key, pieces())


def collect_garbage(rt: Runtime, run: str | None = None) -> int:
    """Delete the blobs on the garbage table that are due, of ``run`` (whose lock the caller
    holds) or of every run whose lock is free. Returns how many went."""
    due = rt.catalog.garbage(run, datetime.now(UTC))
    by_run: dict[str, list[tuple[int, str]]] = {}
    for gid, name, key in due:
        by_run.setdefault(name, []).append((gid, key))
    gone = 0
    for name, items in by_run.items():
        if run is not None:
            gone += _collect(rt, items)
            continue
        with rt.catalog.run_lock(name, blocking=False) as held:
            if held:
                gone += _collect(rt, items)
    return gone


def _collect(rt: Runtime, items: list[tuple[int, str]]) -> int:
    gone = 0
    for gid, key in items:
        if rt.catalog.blob_in_use(key):  # never delete what a checkpoint names
            log.error("blob %r is on the garbage table but a checkpoint names it: kept", key)
        else:
            try:
                rt.store.abort_incomplete([key])
                rt.store.delete(key)
            except (StorageUnavailable, OSError) as exc:
                log.warning("cannot collect blob %r yet: %s", key, exc)
                continue
            gone += 1
        rt.catalog.drop_garbage(gid)
    return gone


class Maintenance:
    """One background thread: after each save, re-roots the run if it is due and collects
    its garbage; every ``period_s`` also the garbage of every run."""

    def __init__(self, rt: Runtime, period_s: float = 60.0) -> None:
        self._rt = rt
        self._period_s = period_s
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._queued: set[str] = set()
        self._busy = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="ckptstore-maintenance")
        self._thread.start()

    def after_save(self, run: str) -> None:
        with self._lock:
            if run in self._queued:
                return
            self._queued.add(run)
            self._busy += 1
        self._queue.put(run)

    @property
    def pending(self) -> int:
        """Runs queued or being worked on."""
        with self._lock:
            return self._busy

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        self._guarded(collect_garbage, self._rt)  # what earlier processes left due
        while True:
            try:
                run = self._queue.get(timeout=self._period_s)
            except queue.Empty:
                self._guarded(collect_garbage, self._rt)
                continue
            if run is None:
                return
            with self._lock:
                self._queued.discard(run)
            try:
                self._guarded(self._maintain, run)
            finally:
                with self._lock:
                    self._busy -= 1

    def _maintain(self, run: str) -> None:
        with self._rt.catalog.run_lock(run, blocking=False) as held:
            if held:
                try:
                    reroot(self._rt, run)
                finally:
                    collect_garbage(self._rt, run)

    @staticmethod
    def _guarded(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # background work: logged, retried at the next save
            log.exception("background maintenance failed")
