"""Blobs as S3 objects: the cluster backend (AWS S3, MinIO, Ceph, anything S3-compatible).

A blob ``key`` is the object ``<prefix>/<key>`` in ``bucket``.

Writes stream: incoming pieces are cut into parts that are uploaded by a small thread pool while
the caller is still producing. At most ``max_concurrency`` parts are in flight and the producer
waits for a free slot, so a write holds about ``(max_concurrency + 2) * part_size`` bytes (parts
in flight, one waiting, one filling). Past 1,000 parts (8 GiB at the default part size) parts
double in size every 1,000 parts to stay within S3's 10,000-part limit. The object only appears
when CompleteMultipartUpload succeeds; any failure aborts the upload. A blob smaller than one
part is one PutObject. Uploads orphaned by a crashed process are listed by ``list_open_uploads`` and
removed by ``abort_stale_uploads`` (or by a bucket lifecycle rule).

Reads of more than two parts fetch part-sized ranges in parallel, pinned to the first response's
ETag so that an object replaced mid-read is re-read rather than torn.

Every wait is bounded, so a store that stops answering (frozen, partitioned) fails an operation
with ``StorageUnavailable`` within seconds rather than minutes: ``connect_timeout`` and
``read_timeout`` bound each socket wait of an attempt, and ``deadline`` bounds one operation --
one request with its retries (one part of a multipart upload, one range of a read, one head) --
as a whole: a retry starts only if a stalled attempt (``connect_timeout + read_timeout``) would
still end within the deadline. A stalled operation therefore fails within
``max(deadline, connect_timeout + read_timeout)`` plus a retry's back-off sleep; an operation
that keeps moving data is never cut (a large part on a slow link takes what it takes). The
clean-up after a failure (aborting a multipart upload, ``discard``) and ``check_ready`` use a
second client with short timeouts (``probe_timeout``) and no retry: a store that just failed is
likely still failing, and the caller's error should not wait on it.

boto3 is an optional dependency (``pip install 'ckptstore[s3]'``), imported when a store is built.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

from ckptstore_core.errors import PayloadTooLarge, StorageUnavailable

from .base import (
    PRESIGNED_SUFFIX,
    BlobNotFound,
    BlobStore,
    Buffer,
    PresignedUpload,
    check_key,
    presigned_since,
)
from .local import check_range
from .queued import take_queued_since

__all__ = ["MAX_PART_SIZE", "MIN_PART_SIZE", "OpenUpload", "S3BlobStore"]

log = logging.getLogger(__name__)

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB  # S3's floor for every part but the last
MAX_PART_SIZE = 5 * 1024 * MiB
MAX_PARTS = 10_000
#: a presigned upload is cut into about this many parts, each of the store's part size at
#: least and PRESIGNED_PART_MAX at most: each part is a URL signed, a PUT (S3 takes 3,500 a
#: second per prefix), a part listed and completed (service CPU: docs/scale.md); the writer
#: holds three parts of memory (two PUTs in flight, one filling)
PRESIGNED_PARTS = 32
PRESIGNED_PART_MAX = 32 * MiB
# Parts double in size every this many parts, so one upload reaches terabytes within S3's
# 10,000-part limit while ordinary blobs keep the configured (memory-friendly) part size.
PARTS_PER_DOUBLING = 1000
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
# Whole-read attempts when the object changes under a multi-request read.
_READ_ATTEMPTS = 3
# botocore's per-call context: the deadline of the call's operation
_DEADLINE_KEY = "ckptstore_deadline"


class _Deadline:
    """The time one operation (a request and its retries, or a read's body attempts) may take.

    ``begin_attempt`` is called before each attempt: the first always starts; a later one only
    if a stalled attempt (``attempt_s``: connect plus read timeout) would end by the deadline.
    """

    def __init__(self, total_s: float, attempt_s: float) -> None:
        queued = take_queued_since()  # a job that waited for a thread: since it was queued
        self.start = time.monotonic() if queued is None else queued
        self.total_s = total_s
        self._attempt_s = attempt_s
        self.attempts = 0
        self._queued = queued is not None
        self.last_error = ""

    def begin_attempt(self) -> None:
        elapsed = time.monotonic() - self.start
        # a queued operation's first attempt, like a retry, only if a stalled one would end
        # by the deadline: queued behind stalled operations, it answers at once
        if (self.attempts or self._queued) and elapsed + self._attempt_s > self.total_s:
            raise _DeadlineExceeded(
                attempts=self.attempts,
                elapsed=elapsed,
                deadline=self.total_s,
                error=self.last_error or "no answer",
            )
        self.attempts += 1


class _DeadlineExceeded(Exception):
    """An operation ran out of time (raised from botocore's request hook, translated to
    ``StorageUnavailable`` by ``S3BlobStore._errors``)."""

    def __init__(self, *, attempts: int, elapsed: float, deadline: float, error: str) -> None:
        super().__init__(
            f"gave up after {attempts} attempt(s) in {elapsed:.1f} s "
            f"(deadline {deadline:g} s, CKPTSTORE_S3_DEADLINE_S): {error}"
        )


@dataclass(frozen=True)
class OpenUpload:
    """A multipart upload that was started and neither completed nor aborted."""

    key: str
    upload_id: str
    initiated: datetime


@dataclass(frozen=True)
class _Piece:
    data: bytes
    total: int  # size of the whole object
    etag: str


class _Part(NamedTuple):
    number: int
    etag: str
    crc32: str  # "" when not used


class _RangeNotSatisfiable(Exception):
    """HTTP 416: the range starts at or past the end of the object."""


class _ObjectChanged(Exception):
    """HTTP 412 on If-Match: the object was replaced between two requests of one read."""


class S3BlobStore(BlobStore):
    """A :class:`BlobStore` over one bucket (and optional key prefix) of an S3-compatible store.

    ``endpoint_url`` selects a non-AWS store (MinIO, Ceph, moto); ``path_style`` addresses the
    bucket in the path rather than the host name, which most of those need. ``create_bucket``
    creates a missing bucket at construction. ``connect_timeout`` and ``read_timeout`` bound
    each socket wait, ``deadline`` one operation with its retries, ``probe_timeout`` the
    clean-up and readiness calls (seconds; see the module docstring); ``max_attempts`` counts
    the first try (botocore "standard" retries, with backoff, on throttling, 5xx and connection
    errors), within the deadline. Credentials come from boto3's usual chain (environment,
    shared config, instance role).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        path_style: bool = False,
        create_bucket: bool = False,
        part_size: int = 8 * MiB,
        max_concurrency: int = 4,
        connect_timeout: float = 5,
        read_timeout: float = 20,
        deadline: float = 60,
        probe_timeout: float = 3,
        max_attempts: int = 5,
    ) -> None:
        try:
            import boto3.session
            from botocore.config import Config
        except ImportError as exc:
            raise ImportError("the S3 blob store needs boto3: pip install 'ckptstore[s3]'") from exc
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid bucket name {bucket!r}")
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ValueError(f"part_size must be in [{MIN_PART_SIZE}, {MAX_PART_SIZE}]")
        if max_concurrency < 1 or max_attempts < 1:
            raise ValueError("max_concurrency and max_attempts must be at least 1")
        if min(connect_timeout, read_timeout, deadline, probe_timeout) <= 0:
            raise ValueError("S3 timeouts and the deadline must be positive")
        prefix = prefix.strip("/")
        self.bucket = bucket
        self.prefix = check_key(prefix) + "/" if prefix else ""
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self._max_attempts = max_attempts
        self.deadline = deadline
        self._attempt_s = connect_timeout + read_timeout
        self._scope = threading.local()  # .deadline: the operation this thread is in

        session = boto3.session.Session()
        addressing = {"addressing_style": "path" if path_style else "auto"}
        config = Config(
            region_name=region,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"mode": "standard", "total_max_attempts": max_attempts},
            # Several calls share the client, each with up to max_concurrency requests.
            max_pool_connections=max(10, 4 * max_concurrency + 2),
            s3=addressing,
            # presigned URLs too: botocore presigns with SigV2 in the older regions unless
            # told (us-east-1 among them), which the regions opened since 2014 refuse, and
            # whose signature covers the Content-Type a client's PUT sends
            signature_version="s3v4",
        )
        self._client = session.client("s3", endpoint_url=endpoint_url, config=config)
        self._client.meta.events.register("request-created.s3", self._before_attempt)
        self._client.meta.events.register("response-received.s3", self._after_attempt)
        # Clean-up and readiness: short timeouts, one attempt.
        probe = Config(
            region_name=region,
            connect_timeout=probe_timeout,
            read_timeout=probe_timeout,
            retries={"mode": "standard", "total_max_attempts": 1},
            max_pool_connections=4,
            s3=addressing,
        )
        self._probe = session.client("s3", endpoint_url=endpoint_url, config=probe)
        self.endpoint_url: str = self._client.meta.endpoint_url
        # Mirror s3transfer: under botocore's default integrity protection ("when_supported")
        # a multipart upload declares CRC32, each part carries one and the completion lists
        # them. AWS_REQUEST_CHECKSUM_CALCULATION=when_required turns it off for stores that
        # reject checksum headers.
        calculation = getattr(self._client.meta.config, "request_checksum_calculation", None)
        self._crc32_parts = calculation == "when_supported"
        if create_bucket:
            self._ensure_bucket()

    def __repr__(self) -> str:
        return f"S3BlobStore({self._where})"

    @property
    def _where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix} at {self.endpoint_url}"

    def close(self) -> None:
        self._client.close()
        self._probe.close()

    # -- deadlines ---------------------------------------------------------------------------

    @contextmanager
    def _operation(self) -> Iterator[_Deadline]:
        """One deadline for every request this thread makes inside (an outer one wins)."""
        outer: _Deadline | None = getattr(self._scope, "deadline", None)
        if outer is not None:
            yield outer
            return
        self._scope.deadline = deadline = _Deadline(self.deadline, self._attempt_s)
        try:
            yield deadline
        finally:
            self._scope.deadline = None

    def _before_attempt(self, request: object, **_: object) -> None:
        """botocore hook, before each attempt of a request (retries included), in the
        caller's thread: refuses an attempt the operation's deadline leaves no time for."""
        context: dict[str, object] = getattr(request, "context", {})
        deadline = context.get(_DEADLINE_KEY)
        if not isinstance(deadline, _Deadline):
            scoped = getattr(self._scope, "deadline", None)
            deadline = scoped or _Deadline(self.deadline, self._attempt_s)
            context[_DEADLINE_KEY] = deadline
        deadline.begin_attempt()

    @staticmethod
    def _after_attempt(
        context: dict[str, object],
        exception: object = None,
        parsed_response: object = None,
        **_: object,
    ) -> None:
        """botocore hook, after each attempt: remembers why it failed, for the deadline's
        error message: a network error, or an error the store answered (a throttling
        ``503 SlowDown`` that botocore retries is an answer, not an exception)."""
        deadline = context.get(_DEADLINE_KEY)
        if not isinstance(deadline, _Deadline):
            return
        if exception is not None:
            deadline.last_error = f"{type(exception).__name__}: {exception}"
        elif isinstance(parsed_response, dict) and isinstance(parsed_response.get("Error"), dict):
            error, meta = parsed_response["Error"], parsed_response.get("ResponseMetadata", {})
            status = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
            message = f"{error.get('Code', '')} (HTTP {status}) {error.get('Message', '')}"
            deadline.last_error = message.strip()

    # -- readiness and clean-up ------------------------------------------------------------

    def check_ready(self) -> None:
        """List at most one key under the prefix (what the service's own listings need),
        with the short probe timeout and no retry."""
        with self._errors("readiness check (list)"):
            self._probe.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)

    def presigned_get(self, key: str, expires_s: int) -> str:
        # signed here, with no request: SigV4 covers the key and the expiry, not the Range
        full = self.prefix + check_key(key)
        params = {"Bucket": self.bucket, "Key": full}
        with self._errors("presign", key):
            url: str = self._client.generate_presigned_url(
                "get_object", Params=params, ExpiresIn=expires_s
            )
        return url

    presigns = True

    def presigned_upload(self, key: str, max_bytes: int, expires_s: int) -> PresignedUpload:
        # no checksum algorithm: a client's plain PUT carries none, and the completion
        # would have to list one per part
        if not key.endswith(PRESIGNED_SUFFIX):
            raise ValueError(f"a presigned upload's key ends in {PRESIGNED_SUFFIX}: {key!r}")
        part_size = self.presigned_part_size(max_bytes)
        parts = max(1, -(-max_bytes // part_size))
        if parts > MAX_PARTS:
            raise PayloadTooLarge(
                f"an upload of {max_bytes} bytes takes {parts} parts of {part_size} "
                f"bytes, more than S3's {MAX_PARTS}"
            )
        full = self.prefix + check_key(key)
        with self._errors("start multipart upload of", key):
            upload_id = str(
                self._client.create_multipart_upload(Bucket=self.bucket, Key=full)["UploadId"]
            )
            urls = tuple(
                self._client.generate_presigned_url(
                    "upload_part",
                    Params={
                        "Bucket": self.bucket,
                        "Key": full,
                        "UploadId": upload_id,
                        "PartNumber": n,
                    },
                    ExpiresIn=expires_s,
                )
                for n in range(1, parts + 1)
            )
        return PresignedUpload(upload_id, part_size, urls)

    def presigned_part_size(self, max_bytes: int) -> int:
        """The part size of a presigned upload of at most ``max_bytes``: about
        :data:`PRESIGNED_PARTS` parts, whole MiB, within ``[part_size, PRESIGNED_PART_MAX]``
        (never below the store's part size)."""
        even = -(-max(max_bytes, 1) // PRESIGNED_PARTS)
        even = -(-even // MiB) * MiB
        return max(self.part_size, min(even, PRESIGNED_PART_MAX))

    def complete_presigned(self, key: str, upload_id: str, size: int) -> int:
        full = self.prefix + check_key(key)
        listed: list[tuple[int, int, str]] = []
        paginator = self._client.get_paginator("list_parts")
        with self._errors("list the parts of", key):
            for page in paginator.paginate(Bucket=self.bucket, Key=full, UploadId=upload_id):
                for p in page.get("Parts", ()):
                    listed.append((int(p["PartNumber"]), int(p["Size"]), str(p["ETag"])))
        listed.sort()
        numbers = [n for n, _, _ in listed]
        held = sum(n for _, n, _ in listed)
        if numbers != list(range(1, len(listed) + 1)) or held != size:
            raise ValueError(
                f"the upload holds parts {numbers[:5]}{'...' if len(numbers) > 5 else ''} of "
                f"{held} bytes in all, not {size} bytes in parts 1, 2, ..."
            )
        if not listed:  # S3 completes no upload without parts: the empty blob, put
            self.abort_presigned(key, upload_id)
            return self.put_stream(key, [])
        with self._errors("complete multipart upload of", key):
            self._client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, _, e in listed]},
            )
        return size

    def abort_presigned(self, key: str, upload_id: str) -> None:
        from botocore.exceptions import ClientError

        full = self.prefix + check_key(key)
        with self._errors("abort multipart upload of", key):
            try:
                self._probe.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            except ClientError as exc:
                if _code(exc) != "NoSuchUpload":
                    raise

    def abort_presigned_before(self, older_than_s: float) -> int:
        cutoff = time.time() - older_than_s
        stale = [
            up
            for up in self.list_open_uploads()
            if (since := presigned_since(up.key)) is not None and since < cutoff
        ]
        for up in stale:
            self.abort_presigned(up.key, up.upload_id)
        return len(stale)

    def discard(self, key: str) -> None:
        full = self.prefix + check_key(key)
        try:
            with self._errors("delete", key):
                self._probe.delete_object(Bucket=self.bucket, Key=full)
        except BlobNotFound:
            pass

    # -- errors -----------------------------------------------------------------------------

    def _translate(self, exc: Exception, what: str, key: str | None) -> Exception | None:
        """The ckptstore error for a botocore exception, or None for anything else."""
        from botocore.exceptions import BotoCoreError, ClientError

        subject = f"{what} {key!r}" if key is not None else what
        if isinstance(exc, ClientError):
            code, status = _code(exc), _status(exc)
            if key is not None and (code in _NOT_FOUND_CODES or (status == 404 and not code)):
                return BlobNotFound(f"blob {key!r} not found in {self._where}")
            message = exc.response.get("Error", {}).get("Message", "")
            return StorageUnavailable(
                f"S3 {subject} failed on {self._where}: {code} (HTTP {status}) {message}".rstrip()
            )
        if isinstance(exc, (BotoCoreError, _DeadlineExceeded)):
            return StorageUnavailable(f"S3 {subject} failed on {self._where}: {exc}")
        return None

    @contextmanager
    def _errors(self, what: str, key: str | None = None) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            mapped = self._translate(exc, what, key)
            if mapped is None:
                raise
            raise mapped from exc

    def _ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        with self._errors("create bucket"):
            try:
                self._client.head_bucket(Bucket=self.bucket)
                return
            except ClientError as exc:
                if _status(exc) != 404:
                    raise
            region = self._client.meta.region_name
            try:
                if region and region != "us-east-1":
                    self._client.create_bucket(
                        Bucket=self.bucket, CreateBucketConfiguration={"LocationConstraint": region}
                    )
                else:
                    self._client.create_bucket(Bucket=self.bucket)
            except ClientError as exc:
                # Another replica may have won the race.
                if _code(exc) != "BucketAlreadyOwnedByYou":
                    raise

    # -- writes -----------------------------------------------------------------------------

    def put_stream(self, key: str, chunks: Iterable[Buffer]) -> int:
        full = self.prefix + check_key(key)
        part_size = self.part_size
        buf = bytearray()
        size = 0
        upload: _MultipartUpload | None = None
        try:
            for piece in chunks:
                view = memoryview(piece).cast("B")
                size += len(view)
                while len(buf) + len(view) >= part_size:
                    take = part_size - len(buf)
                    buf += view[:take]
                    view = view[take:]
                    if upload is None:
                        upload = _MultipartUpload(self, key, full)
                    # Drop the filled buffer before add_part blocks: one copy held, not two.
                    data, buf = bytes(buf), bytearray()
                    upload.add_part(data)
                    del data
                    part_size = upload.next_part_size()
                buf += view
            if upload is None:
                with self._errors("put", key):
                    self._client.put_object(Bucket=self.bucket, Key=full, Body=bytes(buf))
            else:
                if buf:
                    upload.add_part(bytes(buf))
                upload.complete()
        except BaseException:
            # Also when the caller's iterable raises or is closed: nothing may stay behind.
            if upload is not None:
                upload.abort()
            raise
        return size

    # -- reads ------------------------------------------------------------------------------

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        full = self.prefix + check_key(key)
        if byte_range is None:
            start, end = 0, None
        else:
            start, end = check_range(byte_range)
            if start == end:
                # S3 has no zero-length Range; still report a missing key or a range past the end.
                size = self._head(key, full)
                if end > size:
                    raise ValueError(f"range [{start}, {end}) ends past blob {key!r} ({size} B)")
                return b""
        for _ in range(_READ_ATTEMPTS):
            try:
                return self._get_once(key, full, start, end)
            except _ObjectChanged:
                continue
        raise StorageUnavailable(f"blob {key!r} kept changing while being read in {self._where}")

    def _get_once(self, key: str, full: str, start: int, end: int | None) -> bytes:
        ps = self.part_size
        small = end is not None and end - start <= 2 * ps
        first_end = end if small else start + ps
        assert first_end is not None
        try:
            first = self._fetch(key, full, start, first_end, if_match=None)
        except _RangeNotSatisfiable:
            if end is None:
                # Only an empty object has no byte 0.
                with self._errors("get", key):
                    body = self._client.get_object(Bucket=self.bucket, Key=full)["Body"]
                    return bytes(body.read())
            raise ValueError(f"range [{start}, {end}) ends past blob {key!r}") from None
        if end is None:
            end = first.total
        if end > first.total:
            raise ValueError(f"range [{start}, {end}) ends past blob {key!r} ({first.total} B)")
        if first_end >= end:
            return first.data
        bounds = [(a, min(a + ps, end)) for a in range(first_end, end, ps)]
        with ThreadPoolExecutor(
            max_workers=min(self.max_concurrency, len(bounds)),
            thread_name_prefix="ckptstore-s3-get",
        ) as pool:
            futures = [pool.submit(self._fetch, key, full, a, b, first.etag) for a, b in bounds]
            try:
                rest = [f.result().data for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        return b"".join([first.data, *rest])

    def _fetch(self, key: str, full: str, start: int, end: int, if_match: str | None) -> _Piece:
        """Bytes ``[start, end)`` (clipped to the object), retrying a body cut off mid-read;
        one deadline for all of it."""
        with self._operation() as deadline:
            return self._fetch_within(deadline, key, full, (start, end), if_match)

    def _fetch_within(
        self,
        deadline: _Deadline,
        key: str,
        full: str,
        span: tuple[int, int],
        if_match: str | None,
    ) -> _Piece:
        """:meth:`_fetch` inside its operation's ``deadline``."""
        from botocore.exceptions import (
            ClientError,
            ConnectionClosedError,
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )

        start, end = span
        header = f"bytes={start}-{end - 1}"
        for attempt in range(1, self._max_attempts + 1):
            with self._errors("get", key):
                try:
                    if if_match is None:
                        resp = self._client.get_object(Bucket=self.bucket, Key=full, Range=header)
                    else:
                        resp = self._client.get_object(
                            Bucket=self.bucket, Key=full, Range=header, IfMatch=if_match
                        )
                except ClientError as exc:
                    if _status(exc) == 416 or _code(exc) == "InvalidRange":
                        raise _RangeNotSatisfiable from exc
                    if _status(exc) == 412:
                        raise _ObjectChanged from exc
                    raise
                try:
                    data = bytes(resp["Body"].read())
                except (
                    ResponseStreamingError,
                    IncompleteReadError,
                    ReadTimeoutError,
                    ConnectionClosedError,
                ) as exc:
                    if attempt == self._max_attempts:
                        raise
                    deadline.last_error = f"{type(exc).__name__}: {exc}"
                    continue
            etag = str(resp.get("ETag", ""))
            match = _CONTENT_RANGE.fullmatch(str(resp.get("ContentRange", "")))
            if match is None:
                # The server ignored Range and sent the whole object.
                return _Piece(data[start:end], len(data), etag)
            total = int(match.group(3))
            if len(data) != min(end, total) - start:
                raise StorageUnavailable(
                    f"S3 get {key!r} on {self._where}: short body "
                    f"({len(data)} bytes for range {start}-{end - 1} of {total})"
                )
            return _Piece(data, total, etag)
        raise AssertionError("unreachable")

    def _head(self, key: str, full: str) -> int:
        with self._errors("head", key):
            return int(self._client.head_object(Bucket=self.bucket, Key=full)["ContentLength"])

    def exists(self, key: str) -> bool:
        try:
            self._head(key, self.prefix + check_key(key))
        except BlobNotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        full = self.prefix + check_key(key)
        try:
            with self._errors("delete", key):
                self._client.delete_object(Bucket=self.bucket, Key=full)
        except BlobNotFound:
            pass  # S3 itself answers 204; some compatible stores say NoSuchKey

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        pages = iter(paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix))
        cut = len(self.prefix)
        while True:
            # Pages are fetched lazily: translate each fetch, not the caller's loop body.
            with self._errors("list"):
                page = next(pages, None)
            if page is None:
                return
            for obj in page.get("Contents", ()):
                yield str(obj["Key"])[cut:]

    # -- garbage collection -----------------------------------------------------------------

    def list_open_uploads(self) -> list[OpenUpload]:
        """Multipart uploads under this store's prefix that were neither completed nor aborted."""
        paginator = self._client.get_paginator("list_multipart_uploads")
        out: list[OpenUpload] = []
        cut = len(self.prefix)
        with self._errors("list multipart uploads"):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
                for up in page.get("Uploads", ()):
                    out.append(OpenUpload(str(up["Key"])[cut:], up["UploadId"], up["Initiated"]))
        return out

    def abort_stale_uploads(self, older_than_s: float) -> int:
        """Abort open uploads started more than ``older_than_s`` ago; returns how many.

        Call it at start-up (and now and then) with a margin longer than any upload takes: an
        upload still being written by another replica would be aborted too.
        """
        return self.abort_incomplete((), older_than_s)

    def abort_incomplete(
        self, keys: Collection[str] = (), older_than_s: float | None = None
    ) -> int:
        from botocore.exceptions import ClientError

        dead = set(keys)
        cutoff = (
            None if older_than_s is None else datetime.now(UTC) - timedelta(seconds=older_than_s)
        )
        aborted = 0
        for up in self.list_open_uploads():
            if up.key not in dead and (cutoff is None or up.initiated >= cutoff):
                continue
            with self._errors("abort multipart upload of", up.key):
                try:
                    self._client.abort_multipart_upload(
                        Bucket=self.bucket, Key=self.prefix + up.key, UploadId=up.upload_id
                    )
                except ClientError as exc:
                    if _code(exc) != "NoSuchUpload":
                        raise
                    continue
            aborted += 1
        return aborted


class _MultipartUpload:
    """One multipart upload fed part by part from ``put_stream``'s thread."""

    def __init__(self, store: S3BlobStore, key: str, full: str) -> None:
        self._store = store
        self._key = key
        self._full = full
        self._crc32 = store._crc32_parts
        with store._errors("start multipart upload of", key):
            if self._crc32:
                resp = store._client.create_multipart_upload(
                    Bucket=store.bucket, Key=full, ChecksumAlgorithm="CRC32"
                )
            else:
                resp = store._client.create_multipart_upload(Bucket=store.bucket, Key=full)
        self._upload_id = str(resp["UploadId"])
        self._pool = ThreadPoolExecutor(
            max_workers=store.max_concurrency, thread_name_prefix="ckptstore-s3-put"
        )
        self._pending: set[Future[_Part]] = set()
        self._parts: list[_Part] = []
        self._submitted = 0

    def next_part_size(self) -> int:
        return min(self._store.part_size << (self._submitted // PARTS_PER_DOUBLING), MAX_PART_SIZE)

    def add_part(self, data: bytes) -> None:
        """Queue a part; blocks while ``max_concurrency`` parts are in flight."""
        if self._submitted == MAX_PARTS:
            raise PayloadTooLarge(f"blob {self._key!r} needs more than {MAX_PARTS} S3 parts")
        self._collect(block=False)
        while len(self._pending) >= self._store.max_concurrency:
            self._collect(block=True)
        self._submitted += 1
        self._pending.add(self._pool.submit(self._upload_part, self._submitted, data))

    def _collect(self, *, block: bool) -> None:
        """Record finished parts; raises the first part's error, so failures surface early."""
        if block:
            done, self._pending = wait(self._pending, return_when=FIRST_COMPLETED)
        else:
            done = {f for f in self._pending if f.done()}
            self._pending -= done
        for f in done:
            self._parts.append(f.result())

    def _upload_part(self, number: int, data: bytes) -> _Part:
        store = self._store
        with store._errors(f"upload part {number} of", self._key):
            if self._crc32:
                resp = store._client.upload_part(
                    Bucket=store.bucket,
                    Key=self._full,
                    UploadId=self._upload_id,
                    PartNumber=number,
                    Body=data,
                    ChecksumAlgorithm="CRC32",
                )
            else:
                resp = store._client.upload_part(
                    Bucket=store.bucket,
                    Key=self._full,
                    UploadId=self._upload_id,
                    PartNumber=number,
                    Body=data,
                )
        return _Part(number, str(resp["ETag"]), str(resp.get("ChecksumCRC32", "")))

    def complete(self) -> None:
        while self._pending:
            self._collect(block=True)
        self._pool.shutdown()
        store = self._store
        parts = sorted(self._parts)
        with store._errors("complete multipart upload of", self._key):
            store._client.complete_multipart_upload(
                Bucket=store.bucket,
                Key=self._full,
                UploadId=self._upload_id,
                MultipartUpload={
                    "Parts": [
                        {"PartNumber": p.number, "ETag": p.etag, "ChecksumCRC32": p.crc32}
                        if p.crc32
                        else {"PartNumber": p.number, "ETag": p.etag}
                        for p in parts
                    ]
                },
            )

    def abort(self) -> None:
        # Let in-flight parts finish first: a part that lands after the abort would linger.
        self._pool.shutdown(wait=True, cancel_futures=True)
        store = self._store
        try:
            with store._errors("abort multipart upload of", self._key):
                store._probe.abort_multipart_upload(
                    Bucket=store.bucket, Key=self._full, UploadId=self._upload_id
                )
        except Exception:
            # The caller's original error matters more; abort_stale_uploads collects this one.
            log.warning(
                "could not abort multipart upload %s of %r",
                self._upload_id,
                self._key,
                exc_info=True,
            )


def _code(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def _status(exc: Exception) -> int:
    meta = getattr(exc, "response", {}).get("ResponseMetadata", {})
    return int(meta.get("HTTPStatusCode", 0))
