"""Blob storage: the :class:`BlobStore` contract and its backends.

``open_blob_store(url)`` builds the backend a settings URL names:

* ``file:///abs/path`` or a plain path: :class:`LocalBlobStore` (the default, one machine);
* ``s3://bucket/optional/prefix``: :class:`~ckptstore_service.storage.s3.S3BlobStore`, which
  needs the ``s3`` extra (boto3) and is imported only when asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from .base import (
    PRESIGNED_SUFFIX,
    BlobNotFound,
    BlobStore,
    Buffer,
    PresignedUpload,
    check_key,
    presigned_key,
)
from .local import LocalBlobStore
from .sink import BlobSink, StreamTarget

__all__ = [
    "PRESIGNED_SUFFIX",
    "presigned_key",
    "PresignedUpload",
    "BlobNotFound",
    "BlobSink",
    "BlobStore",
    "Buffer",
    "LocalBlobStore",
    "S3Timeouts",
    "StreamTarget",
    "check_key",
    "open_blob_store",
]


class S3Timeouts(NamedTuple):
    """The S3 store's waits, in seconds (``S3BlobStore``'s arguments of the same names)."""

    connect_timeout: float = 5
    read_timeout: float = 20
    deadline: float = 60
    probe_timeout: float = 3


def open_blob_store(
    url: str,
    *,
    s3_endpoint_url: str | None = None,
    s3_region: str | None = None,
    s3_path_style: bool = False,
    s3_create_bucket: bool = False,
    s3_timeouts: S3Timeouts | None = None,
) -> BlobStore:
    """The blob store for ``url``; the ``s3_*`` options apply to ``s3://`` URLs only."""
    parts = urlsplit(url)
    if parts.scheme == "" and url:
        return LocalBlobStore(Path(url))
    if parts.query or parts.fragment:
        raise ValueError(f"blob store URL {url!r} must not have a query or fragment")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"file blob store URL must be file:///absolute/path, got {url!r}")
        return LocalBlobStore(Path(unquote(parts.path)))
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ValueError(f"S3 blob store URL must be s3://bucket[/prefix], got {url!r}")
        from .s3 import S3BlobStore

        return S3BlobStore(
            parts.netloc,
            unquote(parts.path).strip("/"),
            endpoint_url=s3_endpoint_url,
            region=s3_region,
            path_style=s3_path_style,
            create_bucket=s3_create_bucket,
            **(s3_timeouts or S3Timeouts())._asdict(),
        )
    raise ValueError(
        f"unsupported blob store URL {url!r}: use file:///absolute/path, a plain path, "
        "or s3://bucket[/prefix]"
    )
