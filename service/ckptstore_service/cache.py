"""The base cache: the newest checkpoint of each active run, materialized on local disk.

A cache file holds a checkpoint's raw data section (tensor bytes back to back at the offsets
the catalog records), so the next save of the run diffs against it without replaying a chain,
and ``latest`` is served from it without decoding. Files are keyed by checkpoint id, so a
replica whose cache is behind the database simply misses and rebuilds from storage.

Bounded by ``max_bytes``, least recently used run evicted first. A file that is replaced or
evicted while a reader has it open stays readable to that reader (POSIX unlink semantics).
The folder is wiped at start-up: nothing in it is trusted across restarts.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BaseCache", "CachedBase"]

_ANY = object()


@dataclass(frozen=True, slots=True)
class CachedBase:
    checkpoint_id: int
    path: Path
    size: int


class BaseCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        shutil.rmtree(root, ignore_errors=True)
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        self._entries: OrderedDict[str, CachedBase] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, run: str, checkpoint_id: int) -> int | None:
        """A read-only fd of the cached checkpoint, or None on a miss. Caller closes it."""
        with self._lock:
            entry = self._entries.get(run)
            if entry is None or entry.checkpoint_id != checkpoint_id:
                return None
            self._entries.move_to_end(run)
            try:
                return os.open(entry.path, os.O_RDONLY)
            except FileNotFoundError:
                del self._entries[run]
                return None

    def new_file(self) -> Path:
        """A fresh temp path to fill; pass it to :meth:`install` or :meth:`discard`."""
        return self.root / "tmp" / uuid.uuid4().hex

    def current(self, run: str) -> int | None:
        """The checkpoint id cached for ``run``, if any."""
        with self._lock:
            entry = self._entries.get(run)
            return None if entry is None else entry.checkpoint_id

    def install(
        self, run: str, checkpoint_id: int, tmp: Path, *, if_current: object = _ANY
    ) -> None:
        """Make ``tmp`` (the data of ``checkpoint_id``, now the run's latest) its cached base.

        With ``if_current``, only if the run's entry is still that checkpoint id (or None):
        a reader filling the cache must not replace what a newer save installed meanwhile.
        """
        size = tmp.stat().st_size
        if size > self.max_bytes:
            self.discard(tmp)
            return
        final = self.root / f"{checkpoint_id}.bin"
        with self._lock:
            old = self._entries.get(run)
            if (
                if_current is not _ANY
                and (None if old is None else old.checkpoint_id) != if_current
            ):
                tmp.unlink(missing_ok=True)
                return
            os.replace(tmp, final)
            if old is not None and old.path != final:
                old.path.unlink(missing_ok=True)
            self._entries[run] = CachedBase(checkpoint_id, final, size)
            self._entries.move_to_end(run)
            total = sum(e.size for e in self._entries.values())
            while total > self.max_bytes and len(self._entries) > 1:
                _, evicted = self._entries.popitem(last=False)
                evicted.path.unlink(missing_ok=True)
                total -= evicted.size
        self.discard(tmp)

    @staticmethod
    def discard(tmp: Path) -> None:
        tmp.unlink(missing_ok=True)
