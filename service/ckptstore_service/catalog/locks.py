"""Run locks: named, exclusive, held by threads, processes and replicas sharing a catalog.

One interface, :class:`RunLocks`, and one implementation per kind of database, chosen once
when the catalog opens (:func:`open_run_locks`):

* :class:`AdvisoryLocks` (PostgreSQL): session advisory locks, each on a connection of its
  own; replicas sharing the database queue up, and the server releases a lock whose holder
  died.
* :class:`FileLocks` (a SQLite file): an flock on a file beside the database; the kernel
  releases it when the holding process dies.
* :class:`ThreadLocks` (an in-memory SQLite database, which one process alone can see):
  thread locks.

A lock is named by a :class:`Purpose` and a run. Purposes are separate namespaces by
construction (not by what a run name may contain): a save's lock on a run never excludes a
re-root of it, nor the other way round.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from enum import StrEnum
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from ckptstore_service.catalog.db import Database, translate_errors

__all__ = [
    "AdvisoryLocks",
    "FileLocks",
    "Purpose",
    "RunLocks",
    "ThreadLocks",
    "open_run_locks",
]


class Purpose(StrEnum):
    """What a lock on a run serializes; each purpose is a namespace of its own."""

    RUN = "run"  # the run's writers: saves, and a re-root's commit
    REROOT = "reroot"  # one re-root (and garbage collection) of the run at a time
    PART = "part"  # one writer's part of a checkpoint, while it uploads ("run#step#part")


class RunLocks(ABC):
    """Exclusive locks named ``(purpose, run)``.

    Contract, the same for every implementation:

    * :meth:`hold` is a context manager yielding True once the lock is held. Blocking, it
      waits for the lock; with ``blocking=False`` it yields False at once if anyone else holds
      it (the caller then must not do what the lock guards).
    * Exclusive between every holder that shares the catalog's database: threads, and (except
      :class:`ThreadLocks`, whose database no other process can see) processes and replicas.
    * Not re-entrant: asking again for a lock one holds waits for oneself, or yields False.
    * Released when the block ends, by return or by exception, and when the holder dies.
    * Locks of different purposes, or of different runs, never exclude each other.
    """

    @abstractmethod
    def hold(
        self, purpose: Purpose, run: str, *, blocking: bool = True
    ) -> AbstractContextManager[bool]:
        """Hold lock ``(purpose, run)`` for the block; yields whether it is held."""

    def close(self) -> None:  # noqa: B027 - only some backends hold resources
        """Release what the backend holds (no lock may be held any more)."""


def open_run_locks(db: Database) -> RunLocks:
    """The run locks that fit ``db``'s backend."""
    if db.is_postgres:
        return AdvisoryLocks(db.url)
    if db.sqlite_file is not None:
        return FileLocks(Path(f"{db.sqlite_file}.locks"))
    return ThreadLocks()


# blake2b personalisations: a namespace per purpose inside the one 64-bit key space of
# advisory locks. RUN's is blake2b's default, so a run lock's key is what it was before
# locks had purposes (replicas of both versions still serialize each other's saves).
_PERSON = {
    Purpose.RUN: b"",
    Purpose.REROOT: b"ckptstore-reroot",
    Purpose.PART: b"ckptstore-part",
}


def advisory_key(purpose: Purpose, run: str) -> int:
    """The PostgreSQL advisory lock key of ``(purpose, run)``."""
    digest = hashlib.blake2b(run.encode(), digest_size=8, person=_PERSON[purpose]).digest()
    return int.from_bytes(digest, "big", signed=True)


class AdvisoryLocks(RunLocks):
    """PostgreSQL session advisory locks, each on a connection of its own."""

    def __init__(self, url: str) -> None:
        # Outside the catalog's pool: an upload holds its lock for its whole duration (and
        # a writer waiting for a run's lock holds a connection while it waits), so from the
        # pool, 30 uploads in progress would take every connection and leave their own
        # queries, and every other request, waiting.
        self._engine = create_engine(url, poolclass=NullPool)

    @contextlib.contextmanager
    def hold(self, purpose: Purpose, run: str, *, blocking: bool = True) -> Iterator[bool]:
        key = advisory_key(purpose, run)
        fn = "pg_advisory_lock" if blocking else "pg_try_advisory_lock"
        with translate_errors(), self._engine.connect() as conn:
            got = conn.execute(text(f"SELECT {fn}(:k)"), {"k": key}).scalar()
            held = blocking or bool(got)
            conn.commit()
            try:
                yield held
            finally:
                if held:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                    conn.commit()

    def close(self) -> None:
        self._engine.dispose()


class FileLocks(RunLocks):
    """flocks on files in ``folder``: ``<run>.lock`` for RUN (the name it always had),
    ``<purpose>/<run>.lock`` for the others.

    A file lives only while its lock is held: the holder unlinks it before releasing, and a
    taker that locked a file which is no longer the one at the path (unlinked meanwhile)
    lets it go and tries again. So no file is left per run, part or step ever locked."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, purpose: Purpose, run: str) -> Path:
        """The file whose flock is lock ``(purpose, run)``."""
        if not run or run in (".", "..") or "/" in run or "\0" in run:
            raise ValueError(f"a run lock needs a name that is a file name, not {run!r}")
        where = self.folder if purpose is Purpose.RUN else self.folder / purpose.value
        return where / f"{run}.lock"

    @contextlib.contextmanager
    def hold(self, purpose: Purpose, run: str, *, blocking: bool = True) -> Iterator[bool]:
        path = self.path(purpose, run)
        fd = _locked(path, blocking)
        if fd is None:
            yield False
            return
        try:
            yield True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # while still held: no one can be holding another file there
            os.close(fd)  # releases the flock


def _locked(path: Path, blocking: bool) -> int | None:
    """An fd of ``path`` holding its flock, the file still at ``path``; None if another
    holds it and ``blocking`` is False."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            return fd
        os.close(fd)  # its holder unlinked it as we waited: take the file there now


class ThreadLocks(RunLocks):
    """Thread locks, for a database that only this process can see."""

    def __init__(self) -> None:
        self._locks: dict[tuple[Purpose, str], threading.Lock] = {}
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def hold(self, purpose: Purpose, run: str, *, blocking: bool = True) -> Iterator[bool]:
        with self._guard:
            lock = self._locks.setdefault((purpose, run), threading.Lock())
        held = lock.acquire(blocking=blocking)
        try:
            yield held
        finally:
            if held:
                lock.release()
