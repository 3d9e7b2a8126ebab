"""Service configuration: one typed class, read from ``CKPTSTORE_*`` environment variables.

Built by the app factory (``create_app(Settings())``), never at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ckptstore_core.retention import RetentionPolicy, parse_keep_best

__all__ = ["Settings"]

MiB = 1 << 20
GiB = 1 << 30


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CKPTSTORE_", extra="ignore")

    data_dir: Path = Field(
        default=Path("ckptstore-data"),
        description="Root for the embedded defaults (SQLite file, blob folder, base cache).",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL; default sqlite:///<data_dir>/catalog.sqlite3. "
        "PostgreSQL: postgresql+psycopg://user@host/db.",
    )
    blob_url: str | None = Field(
        default=None,
        description="file:///abs/path or s3://bucket/prefix; default file://<data_dir>/blobs.",
    )
    cache_dir: Path | None = Field(
        default=None, description="Base cache folder; default <data_dir>/cache."
    )
    cache_bytes: int = Field(
        default=8 * GiB, ge=0, description="Disk budget of the base cache (LRU by run)."
    )
    decoded_cache_bytes: int = Field(
        default=1 * GiB,
        ge=0,
        description="Memory budget of the chunks that loads decoded from storage, kept for "
        "the loads that follow (LRU; 0: none): a second load of a step decodes nothing, and "
        "the next steps start their chains from it.",
    )
    read_ahead: bool = Field(
        default=True,
        description="When loads walk a run's steps in order, decode the next step in the "
        "background into the decoded chunks kept (see read_ahead.py).",
    )
    auto_migrate: bool = Field(
        default=True,
        description="Upgrade the database schema at start-up "
        "(else run `ckptstore-service db upgrade`).",
    )
    incomplete_upload_ttl_s: float = Field(
        default=24 * 3600,
        ge=60,
        description="At start-up, partial writes (temp files, S3 multipart uploads) older "
        "than this are removed even if no catalog row names them; the blobs of a re-root "
        "that crashed are collected this long after it named them.",
    )
    parts_ttl_s: float = Field(
        default=6 * 3600,
        ge=1,
        description="A checkpoint written in parts (a distributed save) that no commit made "
        "visible this long after its first part arrived is abandoned: its parts are deleted.",
    )
    delete_parts_wait_s: float = Field(
        default=10.0,
        ge=0,
        description="An admin delete (of a checkpoint or a run) waits this long for the "
        "run's checkpoint being written in parts to be committed; then that checkpoint is "
        "abandoned: its parts are collected and its commit fails (docs/lifecycle.md).",
    )
    sweep_interval_s: float = Field(
        default=60.0,
        gt=0,
        description="How often the background sweep collects, on every run, garbage that is "
        "due and parts that are abandoned (CKPTSTORE_PARTS_TTL_S) or have no writer.",
    )
    verify_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="How often the verifier looks for committed checkpoints whose chunks "
        "their writers encoded (direct=True) and decodes them (docs/scale.md).",
    )
    url_ttl_s: int = Field(
        default=3600,
        gt=0,
        le=7 * 24 * 3600,
        description="How long the presigned S3 URLs of direct saves and loads live "
        "(docs/scale.md).",
    )
    presign: bool = Field(
        default=True,
        description="Hand direct writers and readers presigned S3 URLs, so that their bytes "
        "bypass the service (false: they go through it, e.g. a bucket the trainers cannot "
        "reach).",
    )
    verify_cpu_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="The share of the verifier's wall time it may spend decoding: it pauses "
        "between chunks to keep to it (1: no pauses).",
    )
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_path_style: bool = False
    s3_create_bucket: bool = False
    s3_connect_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Longest wait to open a connection to S3 (or to send on one), per attempt.",
    )
    s3_read_timeout_s: float = Field(
        default=20.0,
        gt=0,
        description="Longest S3 may go without sending a byte of its answer, per attempt.",
    )
    s3_deadline_s: float = Field(
        default=60.0,
        gt=0,
        description="Longest one S3 request (a part, a range, a head) may take with its "
        "retries: a retry starts only if a stalled attempt would end by then. A frozen store "
        "fails a save or load with 503 storage_unavailable within about this "
        "(docs/deployment.md).",
    )
    database_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="PostgreSQL: longest wait for one database call (a statement, a commit, "
        "the check of a pooled connection) and, in whole seconds (at least 2), to open a "
        "connection (libpq's connect_timeout, unless the URL sets one). A call past it has "
        "its connection cut: a stalled database fails a request with 503 "
        "storage_unavailable within about twice this (docs/operations.md). Schema "
        "migrations are exempt.",
    )
    readiness_timeout_s: float = Field(
        default=3.0,
        gt=0,
        description="GET /readyz: longest wait for the database and for the blob store each "
        "(S3: its probe call's connect and read timeouts; also the clean-up after a failed "
        "S3 write).",
    )

    zstd_level: int = Field(
        default=1, ge=-7, le=22, description="zstd level of byte planes; 1 matched 3 in size."
    )
    chunk_bytes: int = Field(default=4 * MiB, ge=64 << 10, le=256 * MiB)
    keyframe_interval: int = Field(
        default=10, ge=1, description="A full (keyframe) checkpoint every N checkpoints."
    )
    max_chain_depth: int = Field(
        default=10, ge=0, description="Most deltas a chunk may sit on before it is stored whole."
    )
    lossy_max_chain_depth: int = Field(
        default=50,
        ge=0,
        description="Most links a lossy chunk may sit on before a lossy save stores it whole "
        "and exact (docs/lossy.md): a lossy link decodes ~5x faster than a lossless delta, "
        "and each cut costs a full copy of the weights and moments.",
    )
    reroot_depth: int = Field(
        default=8,
        ge=0,
        description="When a save leaves the newest checkpoint this deep (its chain_depth, "
        "a bf16 copy's link included), the chain's full checkpoint moves halfway towards "
        "it, in the background (0: never).",
    )
    reroot_quiet_s: float = Field(
        default=1.0,
        ge=0,
        description="How long a run goes without a save before its re-root starts.",
    )
    garbage_grace_s: float = Field(
        default=3600,
        ge=0,
        description="How long blobs that a re-root replaced stay for loads still reading them.",
    )
    retention_keep_last: int | None = Field(
        default=None,
        ge=1,
        description="Default retention of the runs without a policy of their own: keep the "
        "newest N checkpoints (with the other rules: kept if any rule keeps it; the newest "
        "and pinned ones always). Unset with the other two: keep everything.",
    )
    retention_keep_every: int | None = Field(
        default=None,
        ge=1,
        description="Default retention: keep every checkpoint whose step is a multiple of K.",
    )
    retention_keep_best: str | None = Field(
        default=None,
        description="Default retention: keep the N best checkpoints by a key of their "
        "metadata, written METRIC:min|max:N (eval_loss:min:3).",
    )
    retention_lossy_after: int | None = Field(
        default=None,
        ge=1,
        description="Default archival of the runs without a retention policy of their own: "
        "every checkpoint older than the newest K (not pinned) is re-encoded lossy with the "
        "default lossy parameters, in the background (docs/lossy.md#archival). Unset: "
        "every checkpoint stays bit-exact.",
    )
    max_upload_bytes: int = Field(default=1 << 40, ge=1, description="Largest checkpoint accepted.")
    max_header_bytes: int = Field(default=100 * MiB, ge=1024)
    max_tensors: int = Field(
        default=200_000,
        ge=1,
        description="Most tensors one checkpoint (or one part) may declare; more is a 413. "
        "Each costs catalog rows and bookkeeping, with bytes or without.",
    )
    max_concurrent_uploads: int = Field(
        default=64, ge=1, description="Uploads processed at once; more wait their turn."
    )
    upload_idle_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="An upload whose body sends no byte for this long is cut (408 "
        "request_timeout): its slot and its run's lock are freed.",
    )
    upload_min_rate_bytes_s: float = Field(
        default=1024.0,
        ge=0,
        description="An upload whose body averages fewer bytes per second than this over "
        "CKPTSTORE_UPLOAD_RATE_WINDOW_S is cut (408); 0: no minimum.",
    )
    upload_rate_window_s: float = Field(
        default=60.0, gt=0, description="The window the minimum upload rate is averaged over."
    )
    max_uploads_per_client: int = Field(
        default=0,
        ge=0,
        description="Most upload slots one client holds at once (its token, or its address "
        "when tokens are off); more is a 503 too_many_uploads with Retry-After, which the "
        "client retries. 0: half of CKPTSTORE_MAX_CONCURRENT_UPLOADS.",
    )
    lock_lease_s: float = Field(
        default=15.0,
        ge=1,
        description="PostgreSQL: the lease of a run lock, renewed every third of it by its "
        "holder. A replica that dies (or cannot reach the database) holding a lock blocks "
        "it this long at most; a writer whose lease expired and was taken over has its "
        "commit refused (503 lock_lost).",
    )
    memory_trim_interval_s: float = Field(
        default=5.0,
        ge=0,
        description="How often the service gives memory that requests freed back to the OS "
        "(glibc malloc_trim, when its arenas hold 64 MiB free or more); 0: never.",
    )
    workers: int = Field(default=0, ge=0, description="Codec threads; 0 = number of CPUs.")
    host: str = Field(
        default="127.0.0.1",
        description="The address `ckptstore-service serve` listens on (its --host overrides "
        "it); CKPTSTORE_AUTH=auto decides by it.",
    )
    auth: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Bearer tokens required: on, off, or auto: required unless the service "
        "listens on a loopback address (docs/security.md).",
    )
    metrics: bool = Field(
        default=True,
        description="Serve Prometheus metrics at GET /metrics (docs/metrics.md).",
    )

    @field_validator("retention_keep_best")
    @classmethod
    def _keep_best(cls, value: str | None) -> str | None:
        if value is not None:
            parse_keep_best(value)  # ValueError: a clear message at start-up
        return value

    def default_retention(self) -> RetentionPolicy | None:
        """The retention policy of runs without one of their own; None: keep everything."""
        best = self.retention_keep_best
        policy = RetentionPolicy(
            self.retention_keep_last,
            self.retention_keep_every,
            None if best is None else parse_keep_best(best),
            self.retention_lossy_after,
        )
        return policy if policy.has_rules or policy.archives else None

    def uploads_per_client(self) -> int:
        """The most upload slots one client may hold (CKPTSTORE_MAX_UPLOADS_PER_CLIENT)."""
        return self.max_uploads_per_client or max(1, self.max_concurrent_uploads // 2)

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'catalog.sqlite3').resolve()}"

    def resolved_blob_url(self) -> str:
        return self.blob_url or (self.data_dir / "blobs").resolve().as_uri()

    def resolved_cache_dir(self) -> Path:
        return self.cache_dir or self.data_dir / "cache"
