"""Run locks: named, exclusive, held by threads, processes and replicas sharing a catalog;
each holding carries a fencing token that the commit it guards checks.

One interface, :class:`RunLocks`, and one implementation per kind of database, chosen once
when the catalog opens (:func:`open_run_locks`):

* :class:`LeaseLocks` (PostgreSQL): a lock is a row of ``run_locks`` with a lease that its
  holder renews (a heartbeat thread, every third of the lease); a holder that dies stops
  renewing, and its lock can be taken over once its lease has expired. No connection is
  held while a lock is held (a session advisory lock held one for the whole of an upload,
  and died silently with its session when PostgreSQL restarted), and a lease survives a
  database restart.
* :class:`FileLocks` (a SQLite file): an flock on a file beside the database; the kernel
  releases it when the holding process dies.
* :class:`ThreadLocks` (an in-memory SQLite database, which one process alone can see):
  thread locks.

Fencing, the same on every backend: taking a lock writes its row with a fresh random token
(the :class:`Lease` yielded), and a commit under the lock runs :func:`check_fence` first in
its own transaction. That statement locks the row until the transaction ends and fails
(:class:`~ckptstore_core.errors.LockLost`) unless the row still holds the commit's token.
Whoever takes the lock over replaces the token, and must wait for the row while a commit
holds it: a writer whose lock was lost (its lease expired while it could not reach the
database, and another took it) can never commit after the new holder took the lock, so two
writers never commit into one run at once.

A lock is named by a :class:`Purpose` and a run. Purposes are separate namespaces by
construction (not by what a run name may contain): a save's lock on a run never excludes a
re-root of it, nor the other way round.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from pathlib import Path

from sqlalchemy import delete, func, insert, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from ckptstore_core.errors import LockLost
from ckptstore_service.catalog.db import Database
from ckptstore_service.catalog.models import Base, RunLockRow

__all__ = [
    "FileLocks",
    "Lease",
    "LeaseLocks",
    "Purpose",
    "RunLocks",
    "ThreadLocks",
    "check_fence",
    "open_run_locks",
]

log = logging.getLogger("ckptstore")

_ROWS = Base.metadata.tables[RunLockRow.__tablename__]
#: a PostgreSQL lease's default length: a holder that died blocks its locks this long at most
DEFAULT_LEASE_S = 15.0


class Purpose(StrEnum):
    """What a lock on a run serializes; each purpose is a namespace of its own."""

    RUN = "run"  # the run's writers: saves, and a re-root's commit
    REROOT = "reroot"  # one re-root (and garbage collection) of the run at a time
    PART = "part"  # one writer's part of a checkpoint, while it uploads ("run#step#part")


@dataclass(eq=False)
class Lease:
    """One holding of lock ``(purpose, name)``: its fencing ``token``, which the commit the
    lock guards passes to :func:`check_fence`. ``lost`` says why the holding was found lost
    (by the heartbeat of :class:`LeaseLocks`), None while nothing says so. ``fenced`` is
    False where the lock has no row (:class:`ThreadLocks`: one process, nothing to fence)."""

    purpose: Purpose
    name: str
    token: int
    lost: str | None = None
    fenced: bool = True

    def __bool__(self) -> bool:
        return True


def check_fence(s: Session, lease: Lease) -> None:
    """In a commit's transaction ``s``, before it writes anything: LockLost unless
    ``lease`` still holds its lock. Locks the lock's row until ``s`` ends (an UPDATE, so
    that SQLite takes its write lock here too), so nobody can take the lock over between
    this check and the commit."""
    if not lease.fenced:
        return
    row = s.execute(
        update(_ROWS)
        .where(
            _ROWS.c.purpose == lease.purpose.value,
            _ROWS.c.name == lease.name,
            _ROWS.c.token == lease.token,
        )
        .values(token=_ROWS.c.token)
        .returning(_ROWS.c.token)
    ).first()
    if row is None:
        why = lease.lost or "another writer holds it now, or it was released"
        raise LockLost(
            f"the {lease.purpose.value} lock of {lease.name!r} was lost before the commit "
            f"({why}): nothing was committed; retry"
        )


class RunLocks(ABC):
    """Exclusive locks named ``(purpose, run)``.

    Contract, the same for every implementation:

    * :meth:`hold` is a context manager yielding a :class:`Lease` (true) once the lock is
      held. Blocking, it waits for the lock; with ``blocking=False`` it yields None at once
      if anyone else holds it (the caller then must not do what the lock guards).
    * Exclusive between every holder that shares the catalog's database: threads, and (except
      :class:`ThreadLocks`, whose database no other process can see) processes and replicas.
    * Not re-entrant: asking again for a lock one holds waits for oneself, or yields None.
    * Released when the block ends, by return or by exception, and when the holder dies
      (:class:`LeaseLocks`: once its lease has expired).
    * Fenced: a commit under the lock checks its lease with :func:`check_fence`.
    * Locks of different purposes, or of different runs, never exclude each other.
    """

    @abstractmethod
    def hold(
        self, purpose: Purpose, run: str, *, blocking: bool = True
    ) -> AbstractContextManager[Lease | None]:
        """Hold lock ``(purpose, run)`` for the block; yields its lease, None if refused."""

    def release_mine(self) -> int:
        """Drop the rows of locks that this holder's previous life left (it died holding
        them); how many. Only for a holder whose identity outlives it (a replica's data
        folder), called at start-up before anything is locked."""
        return 0

    def close(self) -> None:  # noqa: B027 - only some backends hold resources
        """Release what the backend holds (no lock may be held any more)."""


def open_run_locks(
    db: Database, holder: str | None = None, lease_s: float = DEFAULT_LEASE_S
) -> RunLocks:
    """The run locks that fit ``db``'s backend; ``holder`` names this process's holdings
    (default: a random name), ``lease_s`` is PostgreSQL's lease."""
    if db.is_postgres:
        return LeaseLocks(db, holder, lease_s)
    if db.sqlite_file is not None:
        return FileLocks(Path(f"{db.sqlite_file}.locks"), db, holder)
    return ThreadLocks()


class _Rows:
    """The ``run_locks`` rows of the backends whose exclusion is elsewhere (flock, thread
    lock): written once the lock is held, deleted before it is released."""

    def __init__(self, db: Database | None, holder: str | None) -> None:
        self._db = db
        self.holder = holder or uuid.uuid4().hex

    def write(self, purpose: Purpose, name: str) -> Lease:
        lease = Lease(purpose, name, _token(), fenced=self._db is not None)
        if self._db is None:
            return lease
        with self._db.session() as s:
            # a row left behind by a holder that died is the lock's previous holding: replaced
            s.execute(delete(_ROWS).where(_ROWS.c.purpose == purpose.value, _ROWS.c.name == name))
            s.execute(
                insert(_ROWS).values(
                    purpose=purpose.value, name=name, token=lease.token, holder=self.holder
                )
            )
        return lease

    def drop(self, lease: Lease) -> None:
        if self._db is not None:
            _drop_row(self._db, lease)

    def drop_holder(self) -> int:
        if self._db is None:
            return 0
        with self._db.session() as s:
            gone = s.execute(
                delete(_ROWS).where(_ROWS.c.holder == self.holder).returning(_ROWS.c.token)
            )
            return len(gone.all())


def _token() -> int:
    return secrets.randbits(63)


def _drop_row(db: Database, lease: Lease, retried: bool = False) -> bool:
    """Delete the lease's row; whether that worked. A failure is logged, not raised: the
    work under the lock is done (a commit happened or not), and what the caller must see is
    its outcome."""
    try:
        with db.session() as s:
            s.execute(
                delete(_ROWS).where(
                    _ROWS.c.purpose == lease.purpose.value,
                    _ROWS.c.name == lease.name,
                    _ROWS.c.token == lease.token,
                )
            )
    except Exception as exc:
        if not retried:
            log.warning(
                "could not release the %s lock of %r (%s: %s): released once the database "
                "answers, or taken over once its lease expires",
                lease.purpose.value,
                lease.name,
                type(exc).__name__,
                exc,
            )
        return False
    return True


class LeaseLocks(RunLocks):
    """PostgreSQL: locks as rows with a lease, renewed by a heartbeat thread; no connection
    is held while a lock is (see the module's docstring).

    Taking a lock is one statement: insert its row, or take over a row whose lease has
    expired (by the database's clock, the same for every replica). A blocking :meth:`hold`
    polls, backing off to ``_POLL_MAX`` s. The heartbeat renews every lease this instance
    holds in one statement; one it finds taken over is marked lost (and its commit will be
    refused by :func:`check_fence`), with the cause logged.
    """

    _POLL_MAX = 0.25
    _RELEASE_RETRY_S = 0.5  # how often the heartbeat retries the release of a lock

    def __init__(self, db: Database, holder: str | None, lease_s: float = DEFAULT_LEASE_S) -> None:
        self._db = db
        self.holder = holder or uuid.uuid4().hex
        self.lease_s = lease_s
        self._held: dict[int, Lease] = {}  # token -> lease
        self._taking: set[int] = set()  # held tokens whose row may not exist yet
        # released by their holder, but their row could not be deleted (the database did
        # not answer): deleted by the heartbeat, or by the next take of the same lock
        self._unreleased: dict[tuple[Purpose, str], Lease] = {}
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._last_renewal_error: str | None = None
        self._thread = threading.Thread(
            target=self._heartbeat, name="ckptstore-lock-heartbeat", daemon=True
        )
        self._thread.start()

    def _take(self, purpose: Purpose, name: str) -> Lease | None:
        with self._guard:
            stale = self._unreleased.pop((purpose, name), None)
        if stale is not None and not _drop_row(self._db, stale, retried=True):
            with self._guard:
                self._unreleased.setdefault((purpose, name), stale)
        lease = Lease(purpose, name, _token())
        expires = func.now() + timedelta(seconds=self.lease_s)
        row = pg_insert(_ROWS).values(
            purpose=purpose.value,
            name=name,
            token=lease.token,
            holder=self.holder,
            expires_at=expires,
        )
        stmt = row.on_conflict_do_update(
            index_elements=[_ROWS.c.purpose, _ROWS.c.name],
            set_={"token": lease.token, "holder": self.holder, "expires_at": expires},
            where=_ROWS.c.expires_at < func.now(),
        ).returning(_ROWS.c.token)
        with self._guard:  # registered before the row exists: the heartbeat renews it
            self._held[lease.token] = lease
            self._taking.add(lease.token)  # and does not count it lost until it exists
        try:
            with self._db.session() as s:
                got = s.execute(stmt).scalar()
        except BaseException:
            with self._guard:
                self._held.pop(lease.token, None)
            raise
        finally:
            with self._guard:
                self._taking.discard(lease.token)
        if got is None:
            with self._guard:
                self._held.pop(lease.token, None)
            return None
        return lease

    @contextlib.contextmanager
    def hold(self, purpose: Purpose, run: str, *, blocking: bool = True) -> Iterator[Lease | None]:
        lease = self._take(purpose, run)
        pause = 0.01
        while lease is None and blocking:
            time.sleep(pause)
            pause = min(pause * 2, self._POLL_MAX)
            lease = self._take(purpose, run)
        if lease is None:
            yield None
            return
        try:
            yield lease
        finally:
            with self._guard:
                self._held.pop(lease.token, None)
            if not _drop_row(self._db, lease):
                with self._guard:
                    self._unreleased[(purpose, run)] = lease

    def _heartbeat(self) -> None:
        renew_at = time.monotonic() + self.lease_s / 3
        while not self._stop.wait(min(self._RELEASE_RETRY_S, self.lease_s / 3)):
            self._release_unreleased()
            if time.monotonic() >= renew_at:
                self.renew()
                renew_at = time.monotonic() + self.lease_s / 3

    def _release_unreleased(self) -> None:
        """Delete the rows of locks released while the database did not answer: a blip at
        the end of a save must not block the run's next save for a whole lease."""
        with self._guard:
            todo = list(self._unreleased.items())
        for key, lease in todo:
            if _drop_row(self._db, lease, retried=True):
                with self._guard:
                    if self._unreleased.get(key) is lease:
                        del self._unreleased[key]

    def renew(self) -> None:
        """Extend every lease held; mark those found taken over as lost (logged)."""
        with self._guard:
            held = dict(self._held)
            taking = set(self._taking)  # a renewal that misses these proves nothing
        if not held:
            return
        try:
            with self._db.session() as s:
                kept = set(
                    s.scalars(
                        update(_ROWS)
                        .where(_ROWS.c.holder == self.holder, _ROWS.c.token.in_(list(held)))
                        .values(expires_at=func.now() + timedelta(seconds=self.lease_s))
                        .returning(_ROWS.c.token)
                    )
                )
        except Exception as exc:
            self._last_renewal_error = f"{type(exc).__name__}: {exc}"
            log.warning(
                "cannot renew %d lock lease(s) (%s): they expire %g s after their last "
                "renewal, and their commits are refused if another writer takes them",
                len(held),
                self._last_renewal_error,
                self.lease_s,
            )
            return
        with self._guard:
            current = set(self._held)
        for token, lease in held.items():
            if token in kept or token not in current or token in taking:
                continue  # kept, released meanwhile, or its row was still being written
            cause = self._last_renewal_error or "no renewal reached the database in time"
            lease.lost = (
                f"its {self.lease_s:g} s lease expired and another writer took it over; "
                f"the last renewal failure: {cause}"
            )
            log.error("the %s lock of %r was lost: %s", lease.purpose.value, lease.name, lease.lost)
        self._last_renewal_error = None

    def release_mine(self) -> int:
        with self._db.session() as s:
            gone = s.execute(
                delete(_ROWS).where(_ROWS.c.holder == self.holder).returning(_ROWS.c.token)
            )
            return len(gone.all())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class FileLocks(RunLocks):
    """flocks on files in ``folder``: ``<run>.lock`` for RUN (the name it always had),
    ``<purpose>/<run>.lock`` for the others; the fencing rows in ``db`` (None: no fencing,
    for the lock alone).

    A file lives only while its lock is held: the holder unlinks it before releasing, and a
    taker that locked a file which is no longer the one at the path (unlinked meanwhile)
    lets it go and tries again. So no file is left per run, part or step ever locked."""

    def __init__(self, folder: Path, db: Database | None = None, holder: str | None = None):
        self.folder = folder
        self._rows = _Rows(db, holder)

    def path(self, purpose: Purpose, run: str) -> Path:
        """The file whose flock is lock ``(purpose, run)``."""
        if not run or run in (".", "..") or "/" in run or "\0" in run:
            raise ValueError(f"a run lock needs a name that is a file name, not {run!r}")
        where = self.folder if purpose is Purpose.RUN else self.folder / purpose.value
        return where / f"{run}.lock"

    @contextlib.contextmanager
    def hold(self, purpose: Purpose, run: str, *, blocking: bool = True) -> Iterator[Lease | None]:
        path = self.path(purpose, run)
        fd = _locked(path, blocking)
        if fd is None:
            yield None
            return
        try:
            lease = self._rows.write(purpose, run)
            try:
                yield lease
            finally:
                self._rows.drop(lease)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # while still held: no one can be holding another file there
            os.close(fd)  # releases the flock

    def release_mine(self) -> int:
        return self._rows.drop_holder()


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
    """Thread locks, for a database that only this process can see (which is one per
    thread unless the engine shares one connection): no row, nothing to fence but threads,
    which the lock excludes; the rows in ``db`` if given."""

    def __init__(self, db: Database | None = None, holder: str | None = None) -> None:
        self._locks: dict[tuple[Purpose, str], threading.Lock] = {}
        self._guard = threading.Lock()
        self._rows = _Rows(db, holder)

    @contextlib.contextmanager
    def hold(self, purpose: Purpose, run: str, *, blocking: bool = True) -> Iterator[Lease | None]:
        with self._guard:
            lock = self._locks.setdefault((purpose, run), threading.Lock())
        if not lock.acquire(blocking=blocking):
            yield None
            return
        try:
            lease = self._rows.write(purpose, run)
            try:
                yield lease
            finally:
                self._rows.drop(lease)
        finally:
            lock.release()
