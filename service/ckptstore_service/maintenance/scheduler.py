"""The service's background work, in one thread: retention, archival to the lossy tier,
re-roots and garbage collection."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ckptstore_core.errors import StorageUnavailable
from ckptstore_core.retention import RetentionPolicy
from ckptstore_service.catalog import Catalog
from ckptstore_service.maintenance.archive import apply_archival, runs_to_archive
from ckptstore_service.maintenance.garbage import collect_garbage, collect_parts
from ckptstore_service.maintenance.reroot import RerootPolicy, Stopped, reroot, reroot_pool
from ckptstore_service.maintenance.retention import apply_retention
from ckptstore_service.metrics import Metrics, Task
from ckptstore_service.storage import BlobStore

__all__ = ["Maintenance"]

log = logging.getLogger("ckptstore")

T = TypeVar("T")

# re-root passes of one run in a row, at most: one run's saves must not starve the others
_MAX_PASSES = 8


class Maintenance:
    """The background work, in one thread: a run's retention policy applied (deleting what
    it does not keep, then moving what it says to the lossy tier: :mod:`.archive`), its
    re-root (if due) and the collection of its garbage, once it has gone ``quiet_s``
    without a save (a re-root then does not compete with a burst of saves for the CPU);
    every ``period_s``, the garbage of every run, and a pass queued for each run with
    checkpoints still to archive (a restart may have cut one short). A run whose re-root
    failed is not re-rooted again for ``retry_s``.

    Starts at construction; :meth:`after_save` after each committed save (and
    :meth:`run_now` once a run's retention policy is set); :meth:`close`
    once, at shutdown. Errors of the background work are logged, never raised; each task's
    runs, errors and results are counted into ``metrics``. A database or store that cannot
    be reached (StorageUnavailable: a PostgreSQL restart) is expected to come back: a pass
    that meets it logs one WARNING line, no traceback, and the next pass tries again.
    """

    def __init__(
        self,
        catalog: Catalog,
        store: BlobStore,
        policy: RerootPolicy,
        *,
        scratch: Path,
        workers: int,
        quiet_s: float,
        parts_ttl_s: float,
        metrics: Metrics,
        period_s: float = 60.0,
        retry_s: float = 600.0,
        retention: RetentionPolicy | None = None,
    ) -> None:
        """``scratch``: a folder for a re-root's spools; ``workers``: the codec threads
        (re-roots get half as many, at a lower priority: :func:`.reroot.reroot_pool`);
        ``parts_ttl_s``: how long a checkpoint written in parts may wait for its commit
        (:func:`.garbage.collect_parts`, at each sweep); ``retention``: the service's
        default policy, for runs without one of their own (None: keep everything)."""
        self._catalog = catalog
        self._store = store
        self._policy = policy
        self._scratch = scratch
        self._period_s = period_s
        self._retry_s = retry_s
        self._quiet_s = quiet_s
        self._parts_ttl_s = parts_ttl_s
        self._metrics = metrics
        self._retention = retention
        self._due: dict[str, float] = {}  # run -> when its pass may start (monotonic)
        self._running = 0
        self._failed: dict[str, float] = {}  # run -> when a re-root may be tried again
        self._pass = ""  # the pass running now, for the log: "the sweep", "run 'r'"
        self._pass_unavailable = False  # its one line saying so is logged
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._pool = reroot_pool(workers)
        self._thread = threading.Thread(target=self._loop, name="ckptstore-maintenance")
        self._thread.start()

    def after_save(self, run: str) -> None:
        """A save of ``run`` committed: a pass of the run is due once it has gone quiet."""
        with self._cond:
            self._due[run] = time.monotonic() + self._quiet_s
            self._cond.notify()

    def run_now(self, run: str) -> None:
        """A pass of ``run`` is due at once (its retention policy was just set)."""
        with self._cond:
            self._due[run] = time.monotonic()
            self._cond.notify()

    @property
    def pending(self) -> int:
        """Runs with a pass queued or running."""
        with self._cond:
            return len(self._due) + self._running

    def close(self) -> None:
        """Stop: a re-root in progress is abandoned (what it wrote is deleted)."""
        self._stop.set()
        with self._cond:
            self._cond.notify()
        self._thread.join()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _next(self, sweep_at: float) -> str | None:
        """The next run to maintain, or None for a sweep of every run (or to stop)."""
        with self._cond:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= sweep_at:
                    return None
                ready = [r for r, t in self._due.items() if t <= now]
                if ready:
                    run = min(ready, key=self._due.__getitem__)
                    del self._due[run]
                    self._running += 1
                    return run
                self._cond.wait(min([sweep_at, *self._due.values()]) - now)
            return None

    def _loop(self) -> None:
        sweep_at = time.monotonic()  # first: what earlier processes left due
        while not self._stop.is_set():
            run = self._next(sweep_at)
            self._begin_pass("the sweep" if run is None else f"run {run!r}")
            if run is None:
                if not self._stop.is_set():
                    self._collect_garbage(None)
                    for pending in (
                        self._guarded("archive", runs_to_archive, self._catalog, self._retention)
                        or []
                    ):
                        self._queue(pending)
                    parts = self._guarded(
                        "parts", collect_parts, self._catalog, self._store, self._parts_ttl_s
                    )
                    self._metrics.parts_collected(parts or [])
                    sweep_at = time.monotonic() + self._period_s
                continue
            try:
                self._guarded("retention", self._retain, run)
                self._guarded("archive", self._archive, run)
                self._guarded("reroot", self._maintain, run)
            finally:
                with self._cond:
                    self._running -= 1

    def _retain(self, run: str) -> None:
        """Delete what the run's retention policy does not keep (:mod:`.retention`)."""
        apply_retention(
            self._catalog,
            self._store,
            run,
            self._policy,
            self._retention,
            scratch=self._scratch,
            pool=self._pool,
            stop=self._stop,
        )

    def _archive(self, run: str) -> None:
        """Move to the lossy tier what the run's policy says (:mod:`.archive`)."""
        try:
            apply_archival(
                self._catalog,
                self._store,
                run,
                self._policy,
                self._retention,
                scratch=self._scratch,
                pool=self._pool,
                stop=self._stop,
            )
        except Stopped:
            return

    def _queue(self, run: str) -> None:
        """A pass of ``run`` is due at once, unless one is queued already."""
        with self._cond:
            self._due.setdefault(run, time.monotonic())

    def _maintain(self, run: str) -> None:
        try:
            if self._failed.get(run, 0.0) <= time.monotonic():
                with self._catalog.reroot_lock(run, blocking=False) as lease:
                    # again while it moved the root: saves made during a re-root can leave
                    # the newest checkpoint still too deep (each pass halves its depth)
                    held = lease is not None
                    passes = 0
                    while held and passes < _MAX_PASSES and not self._stop.is_set():
                        passes += 1
                        done = reroot(
                            self._catalog,
                            self._store,
                            run,
                            self._policy,
                            scratch=self._scratch,
                            pool=self._pool,
                            stop=self._stop,
                        )
                        held = done is not None
                        if done is not None:
                            self._metrics.rerooted(done)
        except Stopped:
            return
        except Exception:
            self._failed[run] = time.monotonic() + self._retry_s
            raise
        finally:
            if not self._stop.is_set():
                self._collect_garbage(run)

    def _collect_garbage(self, run: str | None) -> None:
        """The garbage of ``run`` (None: of every run) that is due."""
        gone = self._guarded("garbage", collect_garbage, self._catalog, self._store, run)
        self._metrics.garbage_collected(gone or 0)

    def _begin_pass(self, name: str) -> None:
        self._pass, self._pass_unavailable = name, False

    def _guarded(self, task: Task, fn: Callable[..., T], *args: object) -> T | None:
        """``fn(*args)``, counted as a run of ``task``; None if it failed (logged: background
        work is retried later, never raised). Storage out of reach is logged once per pass,
        in one line: every task of the pass meets it, and a traceback says nothing more."""
        try:
            result = fn(*args)
        except StorageUnavailable as exc:
            if not self._pass_unavailable:
                self._pass_unavailable = True
                log.warning(
                    "background maintenance failed (%s, %s): %s; tried again in the next pass",
                    self._pass,
                    task,
                    " ".join(str(exc).split()),  # one line: libpq's messages span several
                )
            self._metrics.maintenance_run(task, ok=False)
            return None
        except Exception:
            log.exception("background maintenance failed")
            self._metrics.maintenance_run(task, ok=False)
            return None
        self._metrics.maintenance_run(task, ok=True)
        return result
