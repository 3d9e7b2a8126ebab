"""Rewriting committed chunks in place: what a re-root (:mod:`.reroot`) and a delete
(:mod:`.delete`) share.

Both change how some committed chunks are stored (codec, base, depth, place in a blob) and
nothing else: a chunk row keeps its id, its slice of its tensor, its raw length and its
checksum, so every base id that points at it stays valid. An archival to the lossy tier
(:mod:`.archive`) is the one rewrite that changes a chunk's bytes: its lossy chunks carry
their reconstruction's checksum (:attr:`Rewrite.checksum`). The steps, in order:

1. Re-encode the chunks (:func:`encode_all`, in a thread pool, within a byte budget), each
   new encoding decoded back and checked against its chunk's checksum (:func:`checked`),
   into one spool file per blob that holds a rewritten chunk (:class:`Spools`).
2. Name the new blobs on the garbage table before they are written (:class:`NewBlobs`):
   a crash from there on leaves only blobs that a row names.
3. Write each new blob (:func:`rewrite_blob`): the rewritten chunks from the spool, the
   others copied from the old blob.
4. One transaction commits the new rows, takes the new blobs off the garbage table and puts
   the replaced blobs on it, due after the grace time for loads in progress; if anything
   fails before, :func:`drop_new_blobs` deletes what was written.

A blob is a checkpoint's own, or one of its parts' (a checkpoint written in parts keeps its
chunks in its parts' blobs): everything here is keyed by blob, not by checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor, Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import IO, TypeVar

from ckptstore_core import codec
from ckptstore_core.errors import CorruptData
from ckptstore_service.catalog import Catalog, CheckpointUpdate, ChunkInfo, ChunkUpdate
from ckptstore_service.chains import Piece, WindowReader
from ckptstore_service.maintenance.garbage import delete_blob
from ckptstore_service.storage import BlobSink, BlobStore, Buffer

__all__ = [
    "NewBlobs",
    "Rewrite",
    "Spools",
    "Stopped",
    "checked",
    "checkpoint_figures",
    "drop_new_blobs",
    "encode_all",
    "new_depths",
    "polled",
    "polled_run_lock",
    "rewrite_blob",
    "run_bounded",
]

log = logging.getLogger("ckptstore")
T = TypeVar("T")


class Stopped(Exception):
    """The service is shutting down: a rewrite in progress is abandoned."""


@dataclass(frozen=True, slots=True)
class Rewrite:
    """A chunk's new encoding: ``parts`` are its stored bytes."""

    chunk: ChunkInfo  # the row as it was
    codec: str
    base_id: int | None
    depth: int
    parts: tuple[Buffer, ...]
    checksum: bytes | None = None  # its bytes' new checksum (a lossy chunk's); None: kept


def checked(
    enc: codec.EncodedChunk, base: Piece | None, c: ChunkInfo, expected: bytes | None = None
) -> codec.EncodedChunk:
    """``enc`` once it has decoded back to ``c``'s bytes (a ref: once its base's bytes are
    ``c``'s); with ``expected``, to the bytes of that checksum instead (a lossy chunk's
    reconstruction)."""
    want = c.checksum if expected is None else expected
    if enc.codec == codec.REF:
        if base is None or codec.checksum(base) != want:
            raise CorruptData(f"a ref written for chunk {c.id} does not decode to its bytes")
        return enc
    links: list[tuple[str, Buffer]] = [(enc.codec, enc.payload)]
    if base is not None:
        links.insert(0, (codec.RAW, base))
    codec.decode_chain(links, c.itemsize, c.raw_len, want)
    return enc


@dataclass(frozen=True, slots=True)
class _Spooled:
    codec: str
    base_id: int | None
    depth: int
    offset: int  # in its blob's spool file
    size: int
    checksum: bytes | None


class Spools:
    """The new encodings of each blob, in an unnamed temp file of its own until its new
    blob is written: memory holds only the chunks being re-encoded."""

    def __init__(self, folder: os.PathLike[str]) -> None:
        self._folder = folder
        self.files: dict[str, IO[bytes]] = {}  # old blob key -> its spool
        self.chunks: dict[int, _Spooled] = {}

    def add(self, r: Rewrite) -> None:
        f = self.files.get(r.chunk.blob_key)
        if f is None:
            # closed by close(): one per rewritten blob, open across many calls
            f = tempfile.TemporaryFile(dir=self._folder)  # noqa: SIM115
            self.files[r.chunk.blob_key] = f
        offset = f.seek(0, os.SEEK_END)
        size = 0
        for part in r.parts:
            size += f.write(part)
        self.chunks[r.chunk.id] = _Spooled(r.codec, r.base_id, r.depth, offset, size, r.checksum)

    def read(self, blob: str, s: _Spooled) -> bytes:
        f = self.files[blob]
        f.flush()
        data = os.pread(f.fileno(), s.size, s.offset)
        if len(data) != s.size:
            raise OSError("a rewrite's spool file is shorter than what it wrote")
        return data

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def encode_all(
    jobs: Iterable[tuple[int, Callable[[], list[Rewrite]]]],
    spools: Spools,
    pool: Executor,
    stop: threading.Event | None,
    bytes_in_flight: int,
) -> None:
    """Run the encoding ``jobs`` (each: the raw bytes it holds at once, and a function
    returning its rewrites) in ``pool``, as many at a time as fit ``bytes_in_flight``, and
    spool their results; ``stop``, when set, abandons the work between two jobs."""

    def spool(rewrites: list[Rewrite]) -> None:
        for r in rewrites:
            spools.add(r)

    run_bounded(jobs, spool, pool, stop, bytes_in_flight)


def run_bounded(
    jobs: Iterable[tuple[int, Callable[[], T]]],
    take: Callable[[T], None],
    pool: Executor,
    stop: threading.Event | None,
    bytes_in_flight: int,
) -> None:
    """Run ``jobs`` (each: the bytes it holds at once, and its function) in ``pool``, as
    many at a time as fit ``bytes_in_flight``, handing each result to ``take`` in the jobs'
    order; ``stop``, when set, abandons the work between two jobs (Stopped). A job that
    failed raises its error here; the jobs not started yet are cancelled."""
    pending: deque[tuple[int, Future[T]]] = deque()
    held = 0

    def next_result() -> None:
        nonlocal held
        size, fut = pending.popleft()
        held -= size
        take(fut.result())

    try:
        for size, job in jobs:
            if stop is not None and stop.is_set():
                raise Stopped
            while pending and held + size > bytes_in_flight:
                next_result()
            pending.append((size, pool.submit(job)))
            held += size
        while pending:
            next_result()
    finally:
        for _, fut in pending:
            fut.cancel()


def new_depths(
    catalog: Catalog, rewritten: Mapping[int, int]
) -> tuple[dict[int, int], list[ChunkInfo]]:
    """The depth of every chunk whose chain goes through a rewritten one (``rewritten``:
    their new depths), and those chunks."""
    depth = dict(rewritten)
    below = catalog.descendants(depth.keys())
    by_id = {c.id: c for c in below}
    for c in below:
        stack = []
        while c.id not in depth:
            stack.append(c)
            if c.base_id in depth:
                break
            if c.base_id not in by_id:
                raise CorruptData(f"the catalog's chunk {c.id} lost its base during a rewrite")
            c = by_id[c.base_id]
        for x in reversed(stack):
            assert x.base_id is not None
            depth[x.id] = depth[x.base_id] + (x.codec != codec.REF)
    return depth, below


@dataclass
class NewBlobs:
    """The blobs a rewrite writes, one per blob it rewrites, from the moment they are named
    on the garbage table to its commit."""

    keys: dict[str, str]  # old blob key -> its new blob
    garbage_ids: list[int]  # the new blobs' rows on the garbage table
    rows: dict[int, ChunkUpdate] = field(default_factory=dict)  # chunk id -> its new row
    stored: dict[str, int] = field(default_factory=dict)  # old blob key -> new blob's size


def rewrite_blob(
    store: BlobStore, rows: list[ChunkInfo], blob: str, spools: Spools, new: NewBlobs
) -> None:
    """Write the new blob of ``blob`` (whose chunks are ``rows``, in their order) through a
    :class:`BlobSink`, as a save writes its own: its rewritten chunks from the spool, the
    others copied from the old blob; record every row's new place in ``new``."""
    reader = WindowReader(store, rows)
    sink = BlobSink(store, new.keys[blob])
    try:
        for c in rows:
            spooled = spools.chunks.get(c.id)
            if spooled is None:
                data: Buffer = reader.get(c.blob_key, c.blob_offset, c.blob_offset + c.stored_len)
                offset, _ = sink.write((data,))
                row = replace(ChunkUpdate.of(c), blob_offset=offset)
            else:
                offset, size = sink.write((spools.read(blob, spooled),))
                row = ChunkUpdate(
                    c.id, spooled.codec, spooled.base_id, spooled.depth, offset, size,
                    spooled.checksum,
                )  # fmt: skip
            new.rows[c.id] = row
        new.stored[blob] = sink.finish()
    except BaseException:
        sink.abort()
        raise


def drop_new_blobs(catalog: Catalog, store: BlobStore, keys: Iterable[str]) -> None:
    """After a failed rewrite: delete the blobs it wrote, and their garbage rows; never one
    that a row names (a commit that landed although it reported a failure). What cannot be
    deleted now stays on the table for the collector."""
    for key in keys:
        try:
            if catalog.blob_in_use(key):
                continue
            delete_blob(store, key)
            catalog.forget_garbage(key)
        except Exception as exc:
            log.warning("cannot delete blob %r of a failed rewrite yet: %s", key, exc)


def polled_run_lock(
    catalog: Catalog, run: str, stop: threading.Event | None
) -> AbstractContextManager[object]:
    """The run's lock, waited for in short tries so that a shutdown does not wait for a
    long save to end."""
    return polled(partial(catalog.run_lock, run, blocking=False), stop)


@contextlib.contextmanager
def polled(
    take: Callable[[], AbstractContextManager[T]], stop: threading.Event | None
) -> Iterator[T]:
    """A lock taken in short non-blocking tries (``take()`` yields something false while
    another holds it): a shutdown (``stop``) does not wait on a long save, it raises
    Stopped. Yields what ``take()`` yielded."""
    while True:
        with take() as held:
            if held:
                yield held
                return
        if stop is not None and stop.is_set():
            raise Stopped
        time.sleep(0.05)


def checkpoint_figures(
    catalog: Catalog,
    checkpoint_id: int,
    depth: Mapping[int, int],
    updates: dict[int, ChunkUpdate],
    old_blob_key: str,
    blob_key: str,
    stored_bytes: int,
) -> CheckpointUpdate:
    """Checkpoint ``checkpoint_id``'s figures once its chunks have the new ``depth``s and
    rows (``updates``, chunk id -> new row: completed here with the depth changes of its
    chunks that no rewrite touched)."""
    rows = catalog.chunks(checkpoint_id)
    for c in rows:
        if c.id in updates:
            updates[c.id] = replace(updates[c.id], depth=depth.get(c.id, updates[c.id].depth))
        elif depth.get(c.id, c.depth) != c.depth:
            updates[c.id] = replace(ChunkUpdate.of(c), depth=depth[c.id])
    # a keyframe holds no deltas: its chunks are whole (or copies of whole masters)
    whole = all(
        depth.get(c.id, c.depth) <= (codec.split_cast(updates.get(c.id, c).codec) is not None)
        for c in rows
    )
    return CheckpointUpdate(
        id=checkpoint_id,
        old_blob_key=old_blob_key,
        blob_key=blob_key,
        stored_bytes=stored_bytes,
        chain_depth=max((depth.get(c.id, c.depth) for c in rows), default=0),
        keyframe=whole,
    )
