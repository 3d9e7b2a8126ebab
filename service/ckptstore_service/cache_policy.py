"""Every rule about when the base cache is read, filled, taken and installed, in one place.

:class:`~ckptstore_service.cache.BaseCache` is the mechanism (files, slots, LRU, readers'
locks); this is the policy the save and load paths share:

* **Only a run's latest checkpoint is installed.** A file is installed for checkpoint C of
  run R only if C is R's latest in the catalog when it is installed, and, for a load that
  filled it without the run's lock, only if R's entry did not change while it was filled (a
  save that committed and installed meanwhile is newer).
* **A save reads its base from the cache,** and on a miss rebuilds it from storage into a
  cache file (installed if the parent is still the latest). When the new checkpoint's tensors
  keep their offsets, the save takes the parent's file out of the cache and overwrites it in
  place; else it fills the run's spare or a fresh file.
* **A load of the latest checkpoint from storage fills the cache as it streams,** so a miss
  (a restart, another replica's save) costs one decode, not one per load plus one at the
  run's next save. A load of only some tensors (``prefix``, a ``select``, a DCP
  checkpoint's assembled tensors) cannot fill as it streams: once it ends, the checkpoint
  is decoded into the cache in the background instead (:meth:`CachePolicy.warm`), if it is
  still the run's latest.
* **A checkpoint written in parts is decoded into the cache in the background once
  committed,** by the replica that committed it (the parts' writers never hold the whole
  checkpoint): it is ``latest``, so a resharded load reads it from the cache, and its
  successor's parts read their bases there. A background fill installs only if the
  checkpoint is still the run's latest and the run's entry did not change meanwhile; one
  fill at a time, each checkpoint queued once; a checkpoint larger than the cache is not
  decoded at all.
* **A part reads its bases from the cache when this replica holds its parent,** sharing
  the file with other readers (parts of one checkpoint are saved at the same time: none
  takes the file or overwrites it); on a miss it decodes them from storage, and fills
  nothing (N parts would decode the parent N times).
* **A deleted checkpoint's file is never served nor used as a save's base.** Files are
  found by checkpoint id, and a deleted checkpoint's id never names another one (its row
  stays as a tombstone, :mod:`ckptstore_service.catalog.lifecycle`), so on every replica
  its file can only miss; the replica that deleted it drops the file at once
  (:meth:`~ckptstore_service.cache.BaseCache.forget`). A checkpoint re-based by a delete
  keeps its bytes, and its file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ckptstore_core.codec import file_checksum
from ckptstore_core.errors import StorageUnavailable
from ckptstore_service.cache import ANY, BaseCache, open_reader, write_file
from ckptstore_service.catalog import Catalog, CheckpointRecord, TensorInfo
from ckptstore_service.chains import ChainSource, Piece
from ckptstore_service.metrics import CachePath, Metrics
from ckptstore_service.storage import BlobSink, Buffer

__all__ = ["CachePolicy", "SaveFiles"]

log = logging.getLogger("ckptstore")


@dataclass
class SaveFiles:
    """A save's files: the parent's raw data to read bases from (None for a first save),
    and the new checkpoint's cache file, open for writing (``path``, ``fd``). Set
    ``committed`` to ``(checkpoint_id, size)`` once the checkpoint is committed."""

    base_fd: int | None
    path: Path
    fd: int
    committed: tuple[int, int] | None = None


class _Files:
    """Base-cache files as a :class:`~ckptstore_service.storage.StreamTarget`: the key is
    the file's path, written from its start (a recycled file is cut to size when it is
    installed)."""

    @staticmethod
    def put_stream(key: str, chunks: Iterable[Buffer]) -> int:
        return write_file(Path(key), chunks)


_FILES = _Files()


class CachePolicy:
    def __init__(
        self, cache: BaseCache, catalog: Catalog, source: ChainSource, metrics: Metrics
    ) -> None:
        self.cache = cache
        self._catalog = catalog
        self._source = source
        self._metrics = metrics
        # background fills (warm): one at a time, each (run, checkpoint id) queued once
        self._warmer = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-cache-fill")
        self._warming: set[tuple[str, int]] = set()
        self._warming_lock = threading.Lock()
        self._closing = threading.Event()

    def close(self) -> None:
        """Stop the background fills: queued ones are dropped, a running one is abandoned
        (its file discarded)."""
        self._closing.set()
        self._warmer.shutdown(wait=True, cancel_futures=True)

    def open(self, run: str, checkpoint_id: int, path: CachePath = "load") -> int | None:
        """A read-only fd of the cached checkpoint, or None on a miss (a load's lookup, or
        a part's: ``path``). Caller closes it."""
        fd = self.cache.open(run, checkpoint_id)
        if fd is None:
            fd = self._adopted(run, checkpoint_id)
        self._metrics.base_cache(path, hit=fd is not None)
        return fd

    def _adopted(self, run: str, checkpoint_id: int) -> int | None:
        """A readable fd of the file an earlier process installed for ``checkpoint_id``
        (after a restart), installed again if every tensor in it matches the catalog's
        checksum and it is the run's latest; else None (a torn or foreign file is dropped).
        Checking costs a read and a hash of the file, where a miss decodes its chains."""
        tmp = self.cache.claim(checkpoint_id)
        if tmp is None:
            return None
        try:
            tensors = self._catalog.tensors(checkpoint_id)
            size = max((t.begin + t.nbytes for t in tensors), default=0)
            exact = _holds(tmp, tensors, size)
        except BaseException:
            self.cache.discard(tmp)
            raise
        if not exact:
            log.warning(
                "%s: the cache file a previous process left for checkpoint %d does not match "
                "its checksums: dropped, decoded from storage instead",
                run,
                checkpoint_id,
            )
            self.cache.discard(tmp)
            return None
        self._install_if_latest(run, checkpoint_id, tmp, size, None)
        fd = self.cache.open(run, checkpoint_id)
        if fd is not None:
            log.info(
                "%s: cache file of checkpoint %d kept from a previous process", run, checkpoint_id
            )
        return fd

    @contextlib.contextmanager
    def save_files(
        self, run: str, parent: CheckpointRecord | None, same_offsets: bool
    ) -> Iterator[SaveFiles]:
        """The files of a save of ``run`` against ``parent``; the caller holds the run's lock.
        On exit both fds are closed, then the new file is installed if the caller set
        ``committed`` (no newer checkpoint can have been committed and installed meanwhile,
        the lock saw to that, so only the catalog's latest is checked), else discarded."""
        base_fd = new = None
        try:
            if parent is not None:
                base_fd = self.open(run, parent.id, "save")
                if base_fd is None:
                    base_fd = self._rebuild(run, parent)
                if same_offsets:  # overwritten chunk by chunk, each right after it is read
                    new = self.cache.take(run, parent.id, base_fd)
            path = new or self.cache.new_file(run)
            files = SaveFiles(base_fd, path, os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        except BaseException:
            if base_fd is not None:
                os.close(base_fd)
            if new is not None:
                self.cache.discard(new)  # the cache lost the parent: a later save rebuilds it
            raise
        try:
            yield files
        except BaseException:
            files.committed = None
            raise
        finally:
            try:
                if base_fd is not None:
                    os.close(base_fd)
                os.close(files.fd)
            finally:
                if files.committed is None:
                    self.cache.discard(files.path)
                else:
                    checkpoint_id, size = files.committed
                    self._install_if_latest(run, checkpoint_id, files.path, size, ANY)

    @contextlib.contextmanager
    def part_base(self, run: str, parent: CheckpointRecord) -> Iterator[int | None]:
        """A read-only fd of ``parent``'s cache file for a part's save, shared with other
        readers, or None on a miss: the part then decodes its bases from storage and fills
        nothing (see the module's docstring). Closed on exit."""
        fd = self.open(run, parent.id, "save")
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def _rebuild(self, run: str, parent: CheckpointRecord) -> int:
        """Decode the parent from storage into a cache file (a base-cache miss); returns a
        readable fd of it, installed if the parent is still the run's latest or not."""
        tmp = self.cache.new_file(run)
        try:
            self._source.materialize(parent, tmp)
            fd = open_reader(tmp)
        except BaseException:
            self.cache.discard(tmp)
            raise
        self._install_if_latest(run, parent.id, tmp, parent.raw_bytes, ANY)
        return fd

    def fill(self, info: CheckpointRecord, data: Iterator[Piece]) -> Generator[Piece, None, None]:
        """Pass a load's decoded data through, keeping a copy as the run's base cache if the
        checkpoint is its latest and no newer one is installed by the time it ends. The
        copy is written by a thread of its own (a :class:`BlobSink`, bounded), so the
        load's stream does not wait for the file's writes (docs/benchmarks.md, run 16)."""
        latest = self._catalog.find(info.run, None)
        if latest is None or latest.id != info.id:
            yield from data
            return
        before = self.cache.current(info.run)
        tmp = self.cache.new_file(info.run)
        writer = BlobSink(_FILES, str(tmp))
        size = None
        try:
            for piece in data:
                writer.write((piece,))
                yield piece
            size = writer.finish()
        finally:
            if size is None:
                writer.abort()
                self.cache.discard(tmp)
            else:
                self._install_if_latest(info.run, info.id, tmp, size, before)

    def warm_after(self, info: CheckpointRecord, data: Iterator[Piece]) -> Iterator[Piece]:
        """Pass a load's decoded data through (a load that cannot fill as it streams), then
        :meth:`warm` the checkpoint once the data has all been read."""
        yield from data
        self.warm(info)

    def warm(self, info: CheckpointRecord) -> None:
        """Decode ``info`` into the cache in the background if it is the run's latest (see
        the module's docstring); returns at once. Errors are logged: a fill that failed
        only leaves the next load a decode from storage."""
        key = (info.run, info.id)
        if info.raw_bytes > self.cache.max_bytes or self.cache.current(info.run) == info.id:
            return
        with self._warming_lock:
            if key in self._warming:
                return
            self._warming.add(key)
        try:
            self._warmer.submit(self._warm, info)
        except RuntimeError:  # shut down
            with self._warming_lock:
                self._warming.discard(key)

    def _warm(self, info: CheckpointRecord) -> None:
        """A background fill: the checkpoint decoded from storage through :meth:`fill`
        (which installs it under the one rule), abandoned at :meth:`close`."""
        try:
            latest = self._catalog.find(info.run, None)
            if latest is None or latest.id != info.id or self.cache.current(info.run) == info.id:
                return
            data = self._source.stream(info, self._catalog.tensors(info.id))
            with contextlib.closing(self.fill(info, data)) as filling:
                for _ in filling:
                    if self._closing.is_set():
                        return  # closing the fill discards its file
            log.info("cached %s/%d: %d bytes decoded", info.run, info.step, info.raw_bytes)
        except StorageUnavailable as exc:  # a database restart: a load fills it later
            log.warning(
                "could not cache %s/%d: %s", info.run, info.step, " ".join(str(exc).split())
            )
        except Exception:
            log.exception("could not cache %s/%d", info.run, info.step)
        finally:
            with self._warming_lock:
                self._warming.discard((info.run, info.id))

    def _install_if_latest(
        self, run: str, checkpoint_id: int, tmp: Path, size: int, if_current: object
    ) -> None:
        """The one install rule (see the module's docstring); else ``tmp`` is dropped."""
        latest = self._catalog.find(run, None)
        if latest is not None and latest.id == checkpoint_id:
            self.cache.install(run, checkpoint_id, tmp, size, if_current=if_current)
        else:
            self.cache.discard(tmp)


def _holds(path: Path, tensors: Iterable[TensorInfo], size: int) -> bool:
    """Whether file ``path`` is ``size`` bytes long and holds each of ``tensors`` (its bytes
    at its place) as its checksum says."""
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        return os.fstat(fd).st_size == size and all(
            file_checksum(fd, t.begin, t.nbytes) == t.checksum for t in tensors
        )
