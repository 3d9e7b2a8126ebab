"""Everything a request needs, built once by the app's lifespan: catalog, blob store, base
cache, codec thread pool; at start-up, the collection of crashed uploads
(:func:`~ckptstore_service.maintenance.collect_crashed_uploads`)."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ckptstore_core import planes
from ckptstore_core.pipeline import Budget, ChunkPipeline
from ckptstore_service.cache import BaseCache
from ckptstore_service.cache_policy import CachePolicy
from ckptstore_service.catalog import Catalog
from ckptstore_service.chains import ChainSource, DecodedChunks
from ckptstore_service.maintenance.garbage import collect_crashed_uploads
from ckptstore_service.metrics import Metrics
from ckptstore_service.ranges import DirectLoads
from ckptstore_service.read_ahead import ReadAhead
from ckptstore_service.restore import Loader
from ckptstore_service.save import Saver
from ckptstore_service.save.direct import DirectSaver
from ckptstore_service.save.parts import PartSaver
from ckptstore_service.settings import Settings
from ckptstore_service.storage import BlobStore, S3Timeouts, open_blob_store
from ckptstore_service.storage.queued import QueuedPool

__all__ = ["Runtime"]

log = logging.getLogger("ckptstore")


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory(mmap_below: int = 64 << 20, trim_above: int = 256 << 20) -> bool:
    """Have glibc serve the codec's multi-MiB buffers from its heap and keep freed ones.

    By default each such buffer is a fresh mmap: every save or load of N bytes then faults in
    and zeroes several times N bytes of new pages, and unmaps them again (measured on a cold
    deep load of 70 MB: 23k page faults and 0.3 s of system time; with this, 9k and 0.15 s).
    The price: freed memory is reused rather than returned, so each malloc arena (one per
    busy thread, up to 8 per core) may hold on to up to ``trim_above`` bytes of its own peak;
    the peaks themselves stay bounded by the chunks in flight. Returns whether both settings
    applied (not on other C libraries, nor on a glibc that refuses the values).
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mapped = bool(mallopt(_M_MMAP_THRESHOLD, mmap_below))
    trimmed = bool(mallopt(_M_TRIM_THRESHOLD, trim_above))
    return mapped and trimmed


def replica_name(data_dir: Path) -> str:
    """This replica's name, kept in its data folder (made at its first start): the holder
    of its run locks, so that a replica restarted after a crash releases at once the locks
    it died holding (:meth:`Catalog.release_own_locks`) rather than after their lease. Two
    live replicas must not share a data folder (they would take each other's locks)."""
    path = data_dir / "replica-id"
    try:
        name = path.read_text().strip()
    except FileNotFoundError:
        name = ""
    if not name:
        name = uuid.uuid4().hex
        tmp = path.with_suffix(".tmp")
        tmp.write_text(name + "\n")
        os.replace(tmp, path)
    return name


@dataclass
class Runtime:
    """The service's parts, built once by :meth:`open` and wired to each other here: the
    routes reach the save and load paths (``saver``, ``loader``) through it; the paths
    themselves get the narrow parts they use in their constructors."""

    settings: Settings
    catalog: Catalog
    store: BlobStore
    cache: BaseCache
    pool: ThreadPoolExecutor
    workers: int
    metrics: Metrics = field(default_factory=Metrics)
    budget: Budget = field(init=False)
    source: ChainSource = field(init=False)
    saver: Saver = field(init=False)
    parts: PartSaver = field(init=False)
    direct: DirectSaver = field(init=False)
    ranges: DirectLoads = field(init=False)
    read_ahead: ReadAhead = field(init=False)
    loader: Loader = field(init=False)
    policy: CachePolicy = field(init=False)

    def __post_init__(self) -> None:
        self.budget = Budget(self.workers, self.settings.chunk_bytes)
        decoded = DecodedChunks(self.settings.decoded_cache_bytes, self.metrics.links_decoded)
        self.source = ChainSource(self.catalog, self.store, self.pool, self.budget, decoded)
        self.policy = policy = CachePolicy(self.cache, self.catalog, self.source, self.metrics)
        chunks = ChunkPipeline(
            self.pool, self.budget, self.settings.chunk_bytes, self.settings.zstd_level
        )
        self.saver = Saver(self.catalog, self.store, policy, chunks, self.settings, self.metrics)
        self.read_ahead = ReadAhead(
            self.catalog, self.source, self.cache, self.metrics, self.settings.read_ahead
        )
        self.loader = Loader(self.catalog, policy, self.source, self.read_ahead)
        self.parts = PartSaver(
            self.catalog,
            self.store,
            policy,
            chunks,
            self.settings,
            self.cache.scratch,
            2 * self.budget.bytes_in_flight,
            self.metrics,
            self.source.stream,
        )
        self.direct = DirectSaver(self.catalog, self.store, self.parts, self.settings, self.metrics)
        self.ranges = DirectLoads(
            self.catalog, self.store, self.settings.url_ttl_s, self.settings.presign
        )

    @classmethod
    def open(cls, settings: Settings, metrics: Metrics | None = None) -> Runtime:
        """Open every part; the saves, loads and cache count into ``metrics`` (default: a
        registry of its own)."""
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        catalog = Catalog(
            settings.resolved_database_url(),
            holder=replica_name(settings.data_dir),
            lease_s=settings.lock_lease_s,
            timeout_s=settings.database_timeout_s,
        )
        if settings.auto_migrate:
            catalog.upgrade()
        elif catalog.revision() is None:
            raise RuntimeError(
                "the database has no schema: run `ckptstore-service db upgrade` first"
            )
        released = catalog.release_own_locks()
        if released:
            log.info("released %d run lock(s) this replica held when it stopped", released)
        store = open_blob_store(
            settings.resolved_blob_url(),
            s3_endpoint_url=settings.s3_endpoint_url,
            s3_region=settings.s3_region,
            s3_path_style=settings.s3_path_style,
            s3_create_bucket=settings.s3_create_bucket,
            s3_timeouts=S3Timeouts(
                settings.s3_connect_timeout_s,
                settings.s3_read_timeout_s,
                settings.s3_deadline_s,
                settings.readiness_timeout_s,
            ),
        )
        cache = BaseCache(settings.resolved_cache_dir(), settings.cache_bytes)
        workers = settings.workers or os.cpu_count() or 2
        # a job's wait for a codec thread counts against its first S3 operation's deadline
        pool = QueuedPool(workers, thread_name_prefix="ckptstore-codec")
        runtime = cls(settings, catalog, store, cache, pool, workers, metrics or Metrics())
        collect_crashed_uploads(catalog, store, settings.incomplete_upload_ttl_s)
        planes.warm_up()  # compile the codec kernels (or load them) before the first request
        catalog.warm_up()  # and the load path's SQL statements
        # Everything alive now (modules, compiled kernels, SQLAlchemy's metadata) lives as
        # long as the process: out of the collector's sight, a full collection no longer
        # walks it. (Measured: one save in ten of a 70 MB state took 0.1 s longer, the one
        # that set off a full collection.)
        gc.freeze()
        if not planes.FUSED:
            log.warning(
                "numba is not installed: the codec runs its numpy reference, 3-10x slower "
                "(pip install 'ckptstore[server]')"
            )
        if not keep_freed_memory():
            log.info("glibc malloc tuning did not apply: codec buffers are fresh pages")
        return runtime

    def close(self) -> None:
        self.policy.close()  # its fills decode in the codec pool: stopped first
        self.read_ahead.close()  # likewise
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()
        self.catalog.close()
        self.cache.close()
