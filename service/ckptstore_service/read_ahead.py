"""Reading ahead: when loads walk a run's steps in order (an evaluation sweep, a loop over
a run's checkpoints, ``ckptstore pull`` of many steps), the next step is decoded in the
background into the decoded chunks kept (:class:`ckptstore_core.chain.DecodedChunks`) while
the caller works on the step it has, so its load is served from memory.

    loader -> loaded(info) after each whole load
           -> the run's first load, or two loads of one run, the second the committed step
              right after the first: the step after it is decoded, in the codec pool,
              keeping what it decodes

Like the operating system's read-ahead of a file read in order, it starts on a run's first
load on this replica (the file's first read: an evaluation sweep's first step; a resume
loads the latest, which has no next step) and on a walk (two consecutive steps loaded one
after the other), not after a jump (back, or forward over a step), reads one step ahead,
one at a time in the process, and only what fits: the step must take at most a third of the
decoded-chunk budget (the step being used and the one before it stay kept), and must not be
the run's latest held in the base cache (served from its file already), nor a step whose
chunks are all kept decoded already (a sweep done again). A load of the step
being read ahead waits for the chunks being decoded and decodes the rest itself (the decoded
chunks' single flight). Errors are logged, never raised: a read-ahead that failed only
leaves the next load its own decode. ``CKPTSTORE_READ_AHEAD=false`` turns it off.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from ckptstore_service.cache import BaseCache
from ckptstore_service.catalog import Catalog, CheckpointRecord
from ckptstore_service.chains import ChainSource, DecodeStats
from ckptstore_service.metrics import Metrics

__all__ = ["ReadAhead"]

log = logging.getLogger("ckptstore")

_RUNS = 1024  # runs whose last load is remembered


class ReadAhead:
    """See the module's docstring."""

    def __init__(
        self,
        catalog: Catalog,
        source: ChainSource,
        cache: BaseCache,
        metrics: Metrics,
        enabled: bool = True,
    ) -> None:
        self._catalog = catalog
        self._source = source
        self._cache = cache
        self._metrics = metrics
        self._enabled = enabled and source.decoded.budget > 0
        self._last: OrderedDict[str, int] = OrderedDict()  # run -> step of its last load
        self._lock = threading.Lock()
        self._busy = False
        self._wanted: CheckpointRecord | None = None  # a walk's load while one was read
        self._closing = threading.Event()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-read-ahead")

    def close(self) -> None:
        self._closing.set()
        self._reader.shutdown(wait=True, cancel_futures=True)

    def loaded(self, info: CheckpointRecord) -> None:
        """A whole load of ``info`` was served: read the step after it ahead if this load is
        the run's first here or continues a walk (see the module's docstring); returns at
        once."""
        if not self._enabled:
            return
        with self._lock:
            before = self._last.pop(info.run, None)
            self._last[info.run] = info.step
            if len(self._last) > _RUNS:
                self._last.popitem(last=False)
            if before is not None and before >= info.step:
                return  # a jump back, or the same step again: no walk
        if before is not None:
            try:
                parent = self._catalog.parent_of(info.run, info.step)
            except Exception:  # the database is away: the load itself was served
                return
            if parent is None or parent.step != before:
                return  # not the step right before: no walk
        with self._lock:
            if self._busy:
                # the load of the step being read ahead often ends with its read-ahead:
                # this walk's next step is read once that one is done
                self._wanted = info
                return
            self._busy = True
        try:
            self._reader.submit(self._walk, info)
        except RuntimeError:  # shut down
            with self._lock:
                self._busy = False

    def _walk(self, info: CheckpointRecord) -> None:
        """Read ahead after ``info``, then after the walk's load that came meanwhile."""
        while True:
            if not self._closing.is_set():
                self._ahead(info)
            with self._lock:
                wanted, self._wanted = self._wanted, None
                if wanted is None or self._closing.is_set():
                    self._busy = False
                    return
            info = wanted

    def _ahead(self, info: CheckpointRecord) -> None:
        try:
            step = self._catalog.next_after(info.run, info.step)
            if (
                step is None
                or 3 * step.raw_bytes > self._source.decoded.budget
                or self._cache.holds(step.run, step.id)
            ):
                return
            chains = self._source.load(step, self._catalog.tensors(step.id), DecodeStats())
            if chains.all_kept():
                return  # a walk loaded again: its next step is in memory already
            for _ in chains.stream():
                if self._closing.is_set():
                    return
            self._metrics.read_ahead(step.raw_bytes)
            log.info("read ahead %s/%d: %d bytes", step.run, step.step, step.raw_bytes)
        except Exception as exc:  # deleted meanwhile, storage down: the load decodes itself
            log.info(
                "read-ahead after %s/%d stopped: %s: %s",
                info.run,
                info.step,
                type(exc).__name__,
                " ".join(str(exc).split()),
            )
