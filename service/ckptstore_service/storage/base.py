"""The blob store contract.

A blob store maps string keys (``runs/<run>/<spread>-<step>-<uuid>.blob``, made by
``ckptstore_service.names.blob_key``; ``/``-separated, no ``..``) to immutable byte strings.
The service writes each checkpoint's encoded chunks as one blob and reads chunks back with
ranged reads.

Contract (every backend, checked by tests/storage/contract.py):

* ``put_stream(key, chunks)`` consumes an iterable of bytes-like pieces and stores their
  concatenation. It is atomic: until it returns, ``exists(key)`` is False and ``get`` raises
  ``BlobNotFound``; if it raises (or the iterable raises, even a ``BaseException``), nothing is
  left visible and any partial state (temp file, multipart upload) is cleaned up; the
  iterable's own exception propagates unchanged. It returns the blob's size. Writing an
  existing key replaces it atomically: readers see the old blob or the new one, never a mix.
  The store copies what it keeps, so a producer may reuse a piece's buffer once it is consumed.
* ``get(key, byte_range=None)`` returns the whole blob or ``[start, end)`` of it. A missing key
  raises ``BlobNotFound`` whatever the range. ``start < 0`` or ``end < start``, or a range that
  ends past the blob, raises ``ValueError``; an empty range inside the blob is ``b""``.
* ``view(key, start, end)`` is ``get(key, (start, end))`` as any bytes-like object, possibly
  without a copy (the local store maps the file); same errors.
* ``exists(key)``; ``delete(key)`` is idempotent (deleting a missing key is not an error).
* ``iter_keys(prefix)`` yields the keys of committed blobs that start with ``prefix`` (a plain
  string prefix, not a folder), sorted by code point (S3's listing order).
* ``discard(key)`` is ``delete`` for the clean-up after a failed write: same effect, but it
  may give up sooner (a store that just failed is likely still failing; the caller's own error
  should not wait on it).
* ``check_ready()`` returns once the store can serve requests now, or raises
  ``StorageUnavailable`` saying why, within a few seconds (the readiness probe, ``/readyz``).
* Every method but ``iter_keys`` raises ``ValueError`` for a key ``check_key`` rejects.
* Backend failures (unreachable, throttled past retries) raise
  ``ckptstore_core.errors.StorageUnavailable`` translated with ``raise ... from exc``.

Implementations are safe to call from several threads at once.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

from ckptstore_core.errors import CkptStoreError
from ckptstore_core.pipeline.sink import Buffer

__all__ = [
    "PRESIGNED_SUFFIX",
    "presigned_key",
    "presigned_since",
    "BlobNotFound",
    "BlobStore",
    "Buffer",
    "PresignedUpload",
    "check_key",
]

#: how the keys of blobs that writers upload themselves end (the sweep aborts theirs)
PRESIGNED_SUFFIX = ".presigned.blob"


def presigned_key(key: str, now: float) -> str:
    """A presigned upload's key for blob key ``key`` (``....blob``), begun at ``now`` (Unix
    seconds): the time is in the key, since stores differ on an upload's ``Initiated``
    (moto reports a fixed date)."""
    return f"{key.removesuffix('.blob')}.{int(now)}{PRESIGNED_SUFFIX}"


def presigned_since(key: str) -> int | None:
    """When the presigned upload of ``key`` began (:func:`presigned_key`), None for a key of
    no presigned upload."""
    if not key.endswith(PRESIGNED_SUFFIX):
        return None
    stamp = key.removesuffix(PRESIGNED_SUFFIX).rpartition(".")[2]
    return int(stamp) if stamp.isascii() and stamp.isdigit() else None


@dataclass(frozen=True)
class PresignedUpload:
    """An upload a client makes straight to the store (:meth:`BlobStore.presigned_upload`):
    its id, the size of every part but the last, one URL per part number (1, 2, ...)."""

    upload_id: str
    part_size: int
    urls: tuple[str, ...]


class BlobNotFound(CkptStoreError):
    """A blob the catalog points at is missing: the store lost data (500)."""

    code = "blob_not_found"
    status = 500


def check_key(key: str) -> str:
    """Reject keys that could escape a prefix or folder; returns the key."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid blob key {key!r}")
    return key


class BlobStore(abc.ABC):
    """Where encoded chunk bytes live. See the module docstring for the contract."""

    @abc.abstractmethod
    def put_stream(self, key: str, chunks: Iterable[Buffer]) -> int: ...

    @abc.abstractmethod
    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes: ...

    def view(self, key: str, start: int, end: int) -> Buffer:
        """``get(key, (start, end))``; backends that can avoid the copy override this."""
        return self.get(key, (start, end))

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def iter_keys(self, prefix: str = "") -> Iterator[str]: ...

    def presigned_get(self, key: str, expires_s: int) -> str | None:
        """A URL that reads blob ``key`` (ranged GETs: a ``Range`` header) without
        credentials for ``expires_s`` seconds, and no other key; None where the store hands
        out none (the service then serves the ranges itself: direct loads)."""
        return None

    #: whether the store hands out presigned URLs (:meth:`presigned_get`, uploads)
    presigns = False

    def presigned_upload(self, key: str, max_bytes: int, expires_s: int) -> PresignedUpload | None:
        """Start an upload of blob ``key`` (ending in :data:`PRESIGNED_SUFFIX`) that a client
        without credentials makes, of at most ``max_bytes``: parts of ``part_size`` bytes
        (the last one shorter), each PUT to its URL (valid ``expires_s`` seconds, for that
        key and upload only); the blob is not visible until :meth:`complete_presigned`.
        None where the store hands out no URLs."""
        return None

    def complete_presigned(self, key: str, upload_id: str, size: int) -> int:
        """Make the presigned upload ``upload_id`` of ``key`` the blob, once its parts hold
        exactly ``size`` bytes (``ValueError`` saying what they hold otherwise; the upload
        is left open). Returns the size."""
        raise ValueError(f"{type(self).__name__} takes no presigned uploads")

    def abort_presigned(self, key: str, upload_id: str) -> None:  # noqa: B027 - optional
        """Abort presigned upload ``upload_id`` of ``key`` (idempotent)."""

    def abort_presigned_before(self, older_than_s: float) -> int:
        """Abort the presigned uploads begun more than ``older_than_s`` ago that nobody
        completed (a writer that died mid-PUT, or never registered); returns how many."""
        return 0

    def discard(self, key: str) -> None:
        """``delete`` after a failed write; backends with long waits bound it tighter."""
        self.delete(key)

    @abc.abstractmethod
    def check_ready(self) -> None:
        """Raise ``StorageUnavailable`` unless the store answers now (bounded: seconds)."""

    def abort_incomplete(
        self, keys: Collection[str] = (), older_than_s: float | None = None
    ) -> int:
        """Clean up writes that a crash cut short; returns how many were removed.

        ``keys``: blobs whose writer is known to be dead (the catalog's stale uploads).
        ``older_than_s``: also anything incomplete started that long ago, whatever its key --
        choose a margin longer than any upload takes, other replicas may be writing. Backends
        whose incomplete writes cannot outlive a crash need not override this.
        """
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and pools."""
