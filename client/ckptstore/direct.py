"""Parts encoded by their writer (``direct=True``): the client runs the core's chunk pipeline
itself and sends what it stored, so the service never encodes (docs/scale.md).

    plan   POST .../plan {"names": [...]}: the parent, the keyframe and depth rules, and the
           parent's tensors and chunks (ckptstore_core.encoded.Plan)
    encode the chunk pipeline (ckptstore_core.pipeline) against this writer's own copy of
           the parent: the raw bytes of the last part it saved of the run, or of the
           tensors it last loaded of it, kept in a file
    send   PUT .../parts/{part}/encoded: header, one frame per chunk as it is encoded,
           then the tail of rows (ckptstore_core.encoded)

**Bases.** A chunk is a delta only against bytes this writer holds and knows to be the
parent's: the raw data of the last part it saved of the run (:class:`BaseFile`, written by
the pipeline as it encodes, on local disk, not in memory), with the tensors a direct load
of the run decoded since (:class:`LoadedBase`: a restarted job's first save is a delta of
what it loaded), tensor by tensor where the plan's parent tensor has the same name, dtype,
shape and checksum. The parent's tensors of the save's names (and dtypes and shapes) that
neither holds are read from the store first where ``read_bases`` (the default,
:data:`READ_BASES`): the direct load's ranged reads and decoder, each tensor checked against
the plan's checksum and added to the run's base file as it comes (:meth:`DirectWriter.
_read_bases`), but for a tensor whose chain would fetch more than :data:`READ_LIMIT`
stored bytes per raw byte of it. Anything else is encoded self-contained (a keyframe, a
parent that is corrupt or cannot be read, a DCP part of another world size: other names).
Memory: the pipeline's budget, ``2 * workers + 2`` chunks in flight (with the default
4 MiB chunks and 2 workers, 24 MiB), plus the pieces queued for the socket (and a read
base's: one tensor and the decoder's read-ahead, as a direct load's); disk: one raw copy
of what was last saved, loaded or read per run (the newest ``keep_runs`` runs), in a
folder of the system's temporary directory (:class:`BasesFolder`) that the writer holds a
lock on: a writer that dies without cleaning up (SIGKILL, ``os._exit``, a node's OOM
killer: a crash is what checkpoints are for) leaves that copy behind, and the next writer
on the machine removes every such folder whose lock no live process holds.

**Part PUTs straight to S3** (``_PartUploader``): each one is retried by itself, to the same
presigned URL with the same bytes, when the store answers what S3 documents as retriable
(``500``, ``502``, ``503``, ``504``: ``SlowDown`` while S3 splits a busy key range,
``InternalError``, ``ServiceUnavailable``) or the connection fails (refused, reset, timed
out): at most :data:`PUT_ATTEMPTS` attempts, :data:`PUT_BACKOFF_S` ``* 2**n`` seconds
(times a jitter of 0.5-1.5, at most :data:`PUT_BACKOFF_MAX_S`) before retry ``n + 1``, each
retry a warning on the ``ckptstore`` logger. A ``403`` (an expired URL: ``UrlExpired``; a
signature mismatch: ``Forbidden``) or any other ``4xx`` is raised at once. The last failure
is a ``StorageUnavailable`` (``RetriedOut``) that the caller's transport does not retry as a
whole part: its attempts would multiply these (a store that takes connections and never
answers would cost ``attempts x (retries + 1)`` timeouts). A gone upload (``404
NoSuchUpload``) is still retried whole, with a new plan and upload.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import http.client
import logging
import os
import queue
import random
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np

from ckptstore.transport import PIECE, RetriedOut, Transport, store_error
from ckptstore_core import codec
from ckptstore_core.encoded import (
    CONTENT_TYPE,
    FRAME_SLACK,
    Plan,
    TailChunk,
    chunk_cut,
    encode_tail,
    frame,
    tail_doc,
)
from ckptstore_core.errors import CkptStoreError, StorageUnavailable
from ckptstore_core.pipeline import (
    BaseChunk,
    Budget,
    Buffer,
    ChunkPipeline,
    DeltaPlanner,
    FileBases,
    Stored,
    TensorInfo,
)
from ckptstore_core.wire import Header, TensorPiece, encode_header

__all__ = [
    "BASES_PREFIX",
    "PUT_ATTEMPTS",
    "PUT_BACKOFF_MAX_S",
    "PUT_BACKOFF_S",
    "READ_BASES",
    "READ_LIMIT",
    "BaseFile",
    "BasesFolder",
    "DirectWriter",
    "LoadedBase",
    "Sent",
    "pieces_of",
    "put_part",
    "remove_orphans",
    "shared_writer",
    "tensor_pieces",
]

log = logging.getLogger("ckptstore")
Spec = tuple[str, str, Sequence[int]]  # a tensor's name, dtype and shape
_BATCH = 1 << 20  # bytes of frames joined into one piece of the request body
_DONE = object()
#: Attempts of one part PUT to the store, the first included (botocore's "standard" retry
#: mode makes 3, the service's S3 backend 5).
PUT_ATTEMPTS = 5
#: Seconds before the first retry of a part PUT, doubled at each, times a jitter of 0.5-1.5.
PUT_BACKOFF_S = 0.5
#: The longest wait before a retry of a part PUT.
PUT_BACKOFF_MAX_S = 8.0
#: Whether a direct save reads the parent's tensors it holds no base for from the store
#: (docs/scale.md, "Bases read from the store": measured there).
READ_BASES = True
#: The most stored bytes a direct save reads as the base of a tensor, per raw byte of it
#: (the tensor's chain: its keyframe and the deltas since; docs/scale.md).
READ_LIMIT = 1.5
#: The store's answers to a part PUT that are retried (S3's retriable errors).
_RETRIED_STATUS = frozenset({500, 502, 503, 504})


@dataclass(frozen=True)
class Sent:
    r"""A part sent: the service's answer, and its raw bytes (a new base file) until the
    caller :meth:`DirectWriter.keep`\ s or :meth:`DirectWriter.discard`\ s them."""

    answer: Any
    key: tuple[str, str]  # the service's URL and the run
    base: BaseFile


@dataclass(frozen=True)
class BaseFile:
    """The raw data section of the last part this writer saved of a run: ``path`` holds
    each tensor of ``tensors`` (its name, dtype, shape, checksum) at its ``begin``."""

    path: str
    tensors: tuple[TensorInfo, ...]


BASES_PREFIX = "ckptstore-bases-"  # a writer's folder in the temporary directory
_OWNER = "owner.lock"  # in it, locked by the writer's process while it lives


class BasesFolder:
    """A writer's folder for its base files in the system's temporary directory (``root``),
    locked (``flock`` on its ``owner.lock``) by this process until :meth:`cleanup` or the
    process's end. Opening one first removes the folders whose lock no process holds
    (:func:`remove_orphans`): their writer died without cleaning up."""

    def __init__(self, root: str | None = None) -> None:
        root = root or tempfile.gettempdir()
        remove_orphans(root)
        self.name = tempfile.mkdtemp(prefix=BASES_PREFIX, dir=root)
        # locked before it takes the name a sweep looks for: no sweep ever finds it free
        fd, locking = tempfile.mkstemp(dir=self.name)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(locking, os.path.join(self.name, _OWNER))
        self._finalizer = weakref.finalize(self, _remove_owned, self.name, fd)

    def cleanup(self) -> None:
        self._finalizer()


def _remove_owned(path: str, lock_fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock_fd)  # after: a sweep must not find the folder free while it is removed


def remove_orphans(root: str) -> list[str]:
    """Remove the writers' folders in ``root`` whose ``owner.lock`` no process holds (a
    folder without one, or that this user cannot open, is left alone); returns them."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(BASES_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            fd = os.open(os.path.join(entry.path, _OWNER), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its writer is alive
        else:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
            log.info("removed %s: the base files of a writer that died", entry.path)
        finally:
            os.close(fd)
    return removed


class DirectWriter:
    """Encodes parts and sends them encoded (see the module's docstring) through the
    :class:`~ckptstore.transport.Transport` each call is given; ``workers`` codec threads.
    Its base files are keyed by service and run, so one writer serves every client of a
    process (:func:`shared_writer`): a DCP save makes a storage writer per checkpoint.
    ``put_attempts`` and ``put_backoff`` bound the retries of each part PUT straight to the
    store (the module's docstring). ``read_bases`` (settable; a save may override it): a
    save reads the parent's tensors this writer holds no base for from the store first
    (:meth:`_read_bases`); ``shared_writer().read_bases = False`` turns that off for the
    process's DCP and ``parts`` saves."""

    def __init__(
        self,
        workers: int | None = None,
        keep_runs: int = 2,
        *,
        put_attempts: int = PUT_ATTEMPTS,
        put_backoff: float = PUT_BACKOFF_S,
        read_bases: bool = READ_BASES,
    ) -> None:
        if put_attempts < 1:
            raise ValueError("put_attempts must be at least 1")
        self._workers = workers or min(4, os.cpu_count() or 2)
        self._put_retries = (put_attempts, put_backoff)
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="ckptstore-encode")
        self._dir = BasesFolder()
        self._bases: OrderedDict[tuple[str, str], BaseFile] = OrderedDict()
        self._keep = keep_runs
        self._lock = threading.Lock()
        self.read_bases = read_bases

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._dir.cleanup()

    def save_part(
        self,
        transport: Transport,
        path: str,
        run: str,
        part: str,
        specs: Sequence[Spec],
        data: Callable[[], Iterator[TensorPiece]],
        *,
        read_bases: bool | None = None,
    ) -> Sent:
        r"""Plan, encode and send part ``part`` of the checkpoint at ``path`` (its URL path)
        of ``run``: the tensors ``specs``, whose bytes ``data`` yields in that order. One
        attempt (the caller retries the whole part). The new raw file becomes the run's base
        once the caller :meth:`keep`\ s it, else :meth:`discard` it. ``read_bases`` (None:
        the writer's :attr:`read_bases`): the parent's tensors this writer holds no base for
        are read from the store first (:meth:`_read_bases`)."""
        names = {"names": [s[0] for s in specs]}
        plan = Plan.from_json(transport.call("POST", path + "/plan", names, retried=False))
        prefix, header = encode_header(list(specs), {})
        key = (transport.url, run)
        if self.read_bases if read_bases is None else read_bases:
            self._read_bases(transport, run, plan, specs)
        with self._lock:
            base = self._bases.get(key)  # one snapshot for the plan and the bytes
        planner, sums = _planner(base, plan, header)
        fd, raw_path = tempfile.mkstemp(dir=self._dir.name)
        os.close(fd)
        result: list[Stored] = []

        def body() -> Iterator[bytes]:
            with (
                open(raw_path, "r+b") as raw,
                open(base.path if base else os.devnull, "rb") as old,
            ):
                pipeline = ChunkPipeline(
                    self._pool, Budget(self._workers, plan.chunk_bytes), plan.chunk_bytes,
                    plan.zstd_level,
                )  # fmt: skip
                bases = _CheckedBases(old.fileno(), sums, run) if base else None
                yield prefix
                run_it = lambda sink: pipeline.run(  # noqa: E731
                    header, data(), planner(), bases, raw.fileno(), sink
                )
                stored = yield from _framed(run_it)
                result[:] = [stored]
                rows = [
                    TailChunk(c.tensor_idx, c.offset, c.raw_len, c.codec, c.checksum)
                    for c in stored.chunks
                ]
                yield encode_tail(plan.parent_id, rows, [t.checksum for t in stored.tensors])

        def straight() -> Any:
            """The part's blob PUT to the store through presigned URLs, then its rows
            registered: the service never sees the bytes."""
            bound = header.data_len + FRAME_SLACK * sum(
                1 for _ in chunk_cut(header, plan.chunk_bytes)
            )
            up = transport.call(
                "POST", f"{path}/parts/{part}/upload", {"max_bytes": bound}, retried=False
            )
            with (
                open(raw_path, "r+b") as raw,
                open(base.path if base else os.devnull, "rb") as old,
                _PartUploader(
                    up["urls"], up["part_size"], transport.timeout, *self._put_retries
                ) as sink,
            ):
                pipeline = ChunkPipeline(
                    self._pool, Budget(self._workers, plan.chunk_bytes), plan.chunk_bytes,
                    plan.zstd_level,
                )  # fmt: skip
                bases = _CheckedBases(old.fileno(), sums, run) if base else None
                stored = pipeline.run(header, data(), planner(), bases, raw.fileno(), sink)
                sizes = sink.finish()
            result[:] = [stored]
            rows = [
                TailChunk(c.tensor_idx, c.offset, c.raw_len, c.codec, c.checksum)
                for c in stored.chunks
            ]
            doc = {
                "key": up["key"],
                "upload_id": up["upload_id"],
                "header": bytes(prefix[8:]).decode(),
                "sizes": sizes,
                "tail": tail_doc(plan.parent_id, rows, [t.checksum for t in stored.tensors]),
            }
            return transport.call("POST", f"{path}/parts/{part}/uploaded", doc, retried=False)

        target = f"{path}/parts/{part}/encoded"
        try:
            if plan.presigned:
                answer = straight()
            else:
                answer = transport.send("PUT", target, body(), None, content_type=CONTENT_TYPE)
        except BaseException:
            os.unlink(raw_path)
            raise
        return Sent(answer, key, BaseFile(raw_path, tuple(result[0].tensors)))

    def _read_bases(
        self, transport: Transport, run: str, plan: Plan, specs: Sequence[Spec]
    ) -> None:
        """The parent's tensors that the plan may diff against (:func:`_unheld`) fetched
        and decoded as a direct load would (``POST .../ranges`` of the parent's step,
        ranged reads, the core's decoder: each chunk and tensor checked against its
        checksum), each one whose checksum is the plan's added to the run's base as it
        comes (:class:`LoadedBase`: one tensor in memory at a time, plus the decoder's
        read-ahead). Not a tensor whose chain would fetch more than :data:`READ_LIMIT`
        stored bytes per raw byte of it. A base is a saving, never a condition: a parent
        that cannot be read (corrupt, gone, the store away) leaves the tensors it did not
        yield self-contained, with a warning."""
        key = (transport.url, run)
        with self._lock:
            base = self._bases.get(key)
        wanted = _unheld(base, plan, specs)
        if not wanted:
            return
        from ckptstore.direct_load import each_parent  # the decoder's imports: when used

        assert plan.parent_step is not None and plan.parent_id is not None
        sums = {t.name: t.checksum for t in wanted}
        try:
            with self.loaded(*key) as into:
                for t, buf in each_parent(
                    transport, run, plan.parent_step, plan.parent_id, sums, self._workers,
                    READ_LIMIT,
                ):  # fmt: skip
                    into.add(t, buf)
        except (CkptStoreError, OSError, ValueError) as exc:
            log.warning(
                "the parent (step %s) of run %r could not be read as a base: its tensors "
                "left are encoded self-contained (%s)",
                plan.parent_step, run, exc,
            )  # fmt: skip

    def keep(self, sent: Sent) -> None:
        """``sent``'s raw bytes are its run's base from now on. Safe before its commit too:
        the next save diffs a tensor against them only where the plan's parent holds the
        same checksum (an uncommitted part's tensors match no parent)."""
        self._install(sent.key, sent.base)

    def loaded(self, url: str, run: str) -> LoadedBase:
        """A base of ``run`` (at the service ``url``) made of the tensors a load decodes:
        add each one as it is checked; closing it makes them the run's base, with the
        previous base's tensors of other names (see :class:`LoadedBase`)."""
        return LoadedBase(self, (url, run))

    def _install(self, key: tuple[str, str], base: BaseFile) -> None:
        with self._lock:
            old = self._bases.pop(key, None)
            if old is not None:
                os.unlink(old.path)
            self._bases[key] = base
            while len(self._bases) > self._keep:
                _, dropped = self._bases.popitem(last=False)
                os.unlink(dropped.path)

    def _open_base(self, key: tuple[str, str]) -> tuple[BaseFile, int] | None:
        """The run's base and a descriptor of its file (the caller closes it), opened under
        the lock: a save's :meth:`keep` may unlink the file right after, the bytes stay."""
        with self._lock:
            base = self._bases.get(key)
            return None if base is None else (base, os.open(base.path, os.O_RDONLY))

    def discard(self, sent: Sent) -> None:
        """``sent``'s raw bytes are no base."""
        os.unlink(sent.base.path)


class LoadedBase:
    """The tensors a load of a run decoded, written to a new base file as they come
    (:meth:`add`: the caller checked each one against its checksum, the plan's own). On
    :meth:`close` the file gets the previous base's tensors of other names too (copied,
    :data:`PIECE` bytes at a time), then becomes the run's base: a load of some tensors
    (a prefix, a DCP rank's pieces) replaces those and keeps the rest. A base is a saving,
    never a condition: a file that cannot be written (a full disk) is dropped with a
    warning and the load goes on."""

    def __init__(self, writer: DirectWriter, key: tuple[str, str]) -> None:
        self._writer = writer
        self._key = key
        self._tensors: list[TensorInfo] = []
        self._written = 0
        fd, self._path = tempfile.mkstemp(dir=writer._dir.name)
        self._fd: int | None = fd

    def __enter__(self) -> LoadedBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, tensor: TensorInfo, data: Buffer) -> None:
        """``tensor``'s bytes, ``data``, checked against ``tensor.checksum`` already."""
        if self._fd is None:
            return
        try:
            _write_all(self._fd, memoryview(data).cast("B"), self._written)
        except OSError as exc:
            self._drop(exc)
            return
        self._tensors.append(replace(tensor, idx=len(self._tensors), begin=self._written))
        self._written += tensor.nbytes

    def close(self) -> None:
        """The file, with the previous base's other tensors, is the run's base from now."""
        if self._fd is None:
            return
        if not self._tensors:
            self._drop(None)
            return
        try:
            self._add_the_rest()
            os.close(self._fd)
        except OSError as exc:
            self._drop(exc)
            return
        self._fd = None
        self._writer._install(self._key, BaseFile(self._path, tuple(self._tensors)))

    def _add_the_rest(self) -> None:
        opened = self._writer._open_base(self._key)
        if opened is None:
            return
        old, fd = opened
        out = self._fd
        assert out is not None
        loaded = {t.name for t in self._tensors}
        try:
            for t in old.tensors:
                if t.name in loaded:
                    continue
                for off in range(0, t.nbytes, PIECE):
                    piece = os.pread(fd, min(PIECE, t.nbytes - off), t.begin + off)
                    _write_all(out, memoryview(piece), self._written + off)
                self._tensors.append(replace(t, idx=len(self._tensors), begin=self._written))
                self._written += t.nbytes
        finally:
            os.close(fd)

    def _drop(self, exc: OSError | None) -> None:
        assert self._fd is not None
        os.close(self._fd)
        self._fd = None
        os.unlink(self._path)
        if exc is not None:
            log.warning("the loaded state is kept as no base for the next direct save: %s", exc)


def _write_all(fd: int, data: memoryview, at: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n


def _unheld(base: BaseFile | None, plan: Plan, specs: Sequence[Spec]) -> list[TensorInfo]:
    """The plan's parent tensors worth reading from the store as a base: one of ``specs``
    (same name, dtype and shape), not empty, that ``base`` does not hold already (same
    checksum), with a chunk a delta may rest on (its chain shorter than the plan's depth
    limit); none where the save is a keyframe or the run's first."""
    if plan.keyframe or plan.parent_step is None:
        return []
    held = set() if base is None else {(t.name, t.dtype, t.shape, t.checksum) for t in base.tensors}
    sent = {(n, d, tuple(s)) for n, d, s in specs}
    shallow = {c.tensor_idx for c in plan.chunks if c.depth < plan.max_chain_depth}
    return [
        t
        for t in plan.tensors
        if (t.name, t.dtype, t.shape) in sent
        and t.nbytes
        and (t.name, t.dtype, t.shape, t.checksum) not in held
        and t.idx in shallow
    ]


def _planner(
    base: BaseFile | None, plan: Plan, header: Header
) -> tuple[Callable[[], DeltaPlanner], dict[int, bytes]]:
    """A planner against the parent's chunks whose bytes ``base`` holds: the tensors of the
    base file that match the plan's parent tensor exactly (name, dtype, shape, checksum), at
    their place in the file (a fresh planner per attempt: it keeps state); and the raw
    checksum of the parent's chunk at each place in the file (:class:`_CheckedBases`)."""
    held = {} if base is None else {(t.name, t.dtype, t.shape, t.checksum): t for t in base.tensors}
    tensors: dict[int, TensorInfo] = {}
    for t in plan.tensors:
        mine = held.get((t.name, t.dtype, t.shape, t.checksum))
        if mine is not None:
            tensors[t.idx] = replace(t, begin=mine.begin)
    chunks = [c for c in plan.chunks if c.tensor_idx in tensors]
    sums = {tensors[c.tensor_idx].begin + c.offset: c.checksum for c in chunks}

    def make() -> DeltaPlanner:
        return DeltaPlanner(
            header,
            keyframe=plan.keyframe,
            since_keyframe=plan.since_keyframe,
            max_chain_depth=plan.max_chain_depth,
            parent_tensors=tensors,
            parent_chunks=chunks,
        )

    return make, sums


class _CheckedBases:
    """A base file's chunks, each checked against the raw checksum the plan gives for the
    parent's chunk at that place before a delta rests on it: bytes that differ (a base file
    changed on disk) are no base, their chunk is encoded on its own, and a warning says so.
    The tensors' checksums matched already; this holds the invariant chunk by chunk, for
    the cost of a hash (xxh3-128: 1-2% of zstd level 1's CPU on the same bytes)."""

    def __init__(self, fd: int, sums: dict[int, bytes], run: str) -> None:
        self._file = FileBases(fd)
        self._sums = sums
        self._run = run

    def read(self, base: BaseChunk, into: np.ndarray) -> memoryview | None:
        data = self._file.read(base, into)
        if codec.checksum(data) == self._sums.get(base.file_offset):
            return data
        log.warning(
            "this process's base of run %r differs from the parent's chunk at "
            "byte %d of its file: that chunk is encoded on its own",
            self._run,
            base.file_offset,
        )
        return None


_shared: DirectWriter | None = None
_shared_lock = threading.Lock()


def _forget_in_child() -> None:
    global _shared, _shared_lock
    # a forked child (a DCP rank, a dataloader worker) has none of the parent's codec
    # threads: it makes a writer of its own at its first use
    _shared, _shared_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def shared_writer() -> DirectWriter:
    """The process's :class:`DirectWriter` (made at first use, closed at exit)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = DirectWriter()
            atexit.register(_shared.close)
        return _shared


class _QueueSink:
    """The pipeline's sink in the encoding thread: each chunk as a frame, queued for the
    request body (bounded: the encoder waits for the socket)."""

    def __init__(self, q: queue.Queue[object], stop: threading.Event) -> None:
        self._q = q
        self._stop = stop
        self.written = 0

    def put(self, item: object) -> None:
        """Queue ``item``; raises once the request gave up (the encoder stops there)."""
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        raise _Cancelled

    def write(self, parts: Iterable[Buffer]) -> tuple[int, int]:
        parts = list(parts)
        size = sum(len(p) for p in parts)
        self.put(frame(size))
        for p in parts:
            self.put(p)
        offset, self.written = self.written, self.written + size
        return offset, size


class _PartUploader:
    """The pipeline's sink of a part uploaded straight to the store: the chunks' stored
    bytes back to back, cut into parts of ``part_size`` bytes, each PUT to its presigned
    URL (retried by itself: :func:`put_part`) by one of two threads while the next one fills
    (memory: 3 parts, each held until its PUT succeeded or failed for good). :meth:`finish`
    PUTs the last one and returns each chunk's size. Leaving the block after a failure
    ends the other PUT's back-off at once."""

    def __init__(
        self,
        urls: list[str],
        part_size: int,
        timeout: float,
        attempts: int = PUT_ATTEMPTS,
        backoff: float = PUT_BACKOFF_S,
    ) -> None:
        self._urls = urls
        self._size = part_size
        self._timeout = timeout
        self._attempts = attempts
        self._backoff = backoff
        self._stop = threading.Event()
        self._buf = bytearray()
        self._sizes: list[int] = []
        self._written = 0
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="ckptstore-put")
        self._pending: list[Future[None]] = []

    def __enter__(self) -> _PartUploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()  # a PUT waiting to retry gives up (its part is not needed now)
        for f in self._pending:
            f.cancel()
        self._pool.shutdown(wait=True)

    def write(self, parts: Iterable[Buffer]) -> tuple[int, int]:
        size = 0
        for p in parts:
            self._buf += p
            size += len(p)
        self._sizes.append(size)
        offset, self._written = self._written, self._written + size
        while len(self._buf) >= self._size:
            self._put(bytes(self._buf[: self._size]))
            del self._buf[: self._size]
        return offset, size

    def _put(self, data: bytes) -> None:
        n = len(self._pending)
        if n >= len(self._urls):
            raise StorageUnavailable(f"the part outgrew its {len(self._urls)} upload URLs")
        self._pending.append(self._pool.submit(self._put_one, self._urls[n], data))
        while sum(not f.done() for f in self._pending) > 2:
            next(f for f in self._pending if not f.done()).result()
        for f in self._pending:
            if f.done():
                f.result()  # raises a failed part's error now

    def _put_one(self, url: str, data: bytes) -> None:
        put_part(
            url, data, self._timeout, attempts=self._attempts, backoff=self._backoff,
            stop=self._stop,
        )  # fmt: skip

    def finish(self) -> list[int]:
        if self._buf:
            self._put(bytes(self._buf))
            self._buf.clear()
        for f in self._pending:
            f.result()
        return self._sizes


def put_part(
    url: str,
    data: bytes,
    timeout: float,
    *,
    attempts: int = PUT_ATTEMPTS,
    backoff: float = PUT_BACKOFF_S,
    stop: threading.Event | None = None,
) -> None:
    """PUT ``data`` to a presigned URL, retried (up to ``attempts`` attempts in all, with
    exponential back-off and jitter, each retry logged) while the store answers ``5xx`` or
    the connection fails; ``stop`` set ends a back-off (the last failure is raised). Typed
    errors: UrlExpired (plan again: also when the URL expired during a back-off),
    Forbidden, StorageUnavailable (the upload gone: the caller retries the whole part;
    RetriedOut: the store away, throttling or refusing past the attempts, not retried
    again), InvalidRequest."""
    for n in range(attempts):
        error = _put_once(url, data, timeout)
        if error is None:
            return
        delay = min(backoff * 2**n, PUT_BACKOFF_MAX_S) * (0.5 + random.random())
        if n + 1 == attempts:
            raise RetriedOut(str(error)) from error.__cause__
        if stop is not None and stop.is_set():
            raise error
        log.warning(
            "%s (part %s); retrying in %.1f s (retry %d of %d)",
            error, _part_number(url), delay, n + 1, attempts - 1,
        )  # fmt: skip
        if stop is None:
            time.sleep(delay)
        elif stop.wait(delay):
            raise error
    raise AssertionError("unreachable")


def _put_once(url: str, data: bytes, timeout: float) -> StorageUnavailable | None:
    """One PUT of ``data`` to ``url``: None once the store took it, the error of a failure
    worth retrying (a ``5xx``, a failed connection); raises the others typed."""
    request = urllib.request.Request(url, data=data, method="PUT")
    request.add_header("Content-Length", str(len(data)))
    # urllib's default (a form) is what S3 servers may try to parse: moto answers 500
    request.add_header("Content-Type", "application/octet-stream")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
        return None
    except urllib.error.HTTPError as exc:
        error = store_error(exc, "PUT of a part")
        if exc.code not in _RETRIED_STATUS or not isinstance(error, StorageUnavailable):
            raise error from exc
        error.__cause__ = exc
        return error
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, cut
        failed = StorageUnavailable(f"the store did not take a part: {exc}")
        failed.__cause__ = exc
        return failed


def _part_number(url: str) -> str:
    """The part number a presigned part URL names (logs show it, never the URL: its query
    is a credential until it expires)."""
    return parse_qs(urlsplit(url).query).get("partNumber", ["?"])[0]


class _Cancelled(Exception):
    """The request body is no longer read: the encoder stops."""


def _framed(run: Callable[[_QueueSink], Stored]) -> Generator[Any, None, Stored]:
    """Run the pipeline in a thread of its own, yielding its frames as they come; returns
    what it stored (a generator's return value) or raises what it raised."""
    q: queue.Queue[object] = queue.Queue(16)
    out: list[Stored | BaseException] = []
    stop = threading.Event()
    sink = _QueueSink(q, stop)

    def work() -> None:
        try:
            out.append(run(sink))
        except BaseException as exc:
            out.append(exc)
        with contextlib.suppress(_Cancelled):
            sink.put(_DONE)

    thread = threading.Thread(target=work, name="ckptstore-direct", daemon=True)
    thread.start()
    batch: list[Any] = []
    size = 0
    try:
        # a chunk's frame prefix and planes are many small pieces: sent as such, each one is
        # a chunk of the request body to parse and hand over on the service's event loop
        while (item := q.get()) is not _DONE:
            assert isinstance(item, bytes | bytearray | memoryview)
            batch.append(item)
            size += len(item)
            if size >= _BATCH:
                yield b"".join(batch)
                batch, size = [], 0
        if batch:
            yield b"".join(batch)
    finally:
        stop.set()  # a consumer gone early: the encoder stops at its next chunk
        thread.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def pieces_of(tensors: Iterable[memoryview]) -> Iterator[TensorPiece]:
    """The tensors' bytes as pipeline pieces, in order, :data:`PIECE` bytes at most each
    (``tensors`` may be a generator: one tensor's bytes made at a time)."""
    for i, data in enumerate(tensors):
        for off in range(0, len(data), PIECE):
            yield TensorPiece(i, off, data[off : off + PIECE])


def tensor_pieces(specs: Sequence[Spec], data: Iterable[Buffer]) -> Iterator[TensorPiece]:
    """The tensors' bytes as pipeline pieces, from ``data``: their bytes back to back in
    ``specs``' order, in pieces of any size (a DCP rank's)."""
    sizes = [t.nbytes for t in encode_header(list(specs), {})[1].tensors]
    i = pos = 0
    for piece in data:
        view = memoryview(piece).cast("B")
        while len(view):
            while i < len(sizes) and pos == sizes[i]:
                i, pos = i + 1, 0
            if i == len(sizes):
                raise ValueError("more tensor bytes than the specs describe")
            take = min(len(view), sizes[i] - pos)
            yield TensorPiece(i, pos, view[:take])
            view, pos = view[take:], pos + take
