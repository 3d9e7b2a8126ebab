from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import boto3
import pytest

from ckptstore.direct import put_part
from ckptstore_core.errors import StorageUnavailable
from ckptstore_service.storage import BlobNotFound, BlobStore, open_blob_store
from ckptstore_service.storage.s3 import MIN_PART_SIZE, S3BlobStore

from .contract import BlobStoreContract, pieces

MiB = 1 << 20


def new_store(endpoint: str, bucket: str | None = None, **kwargs: Any) -> S3BlobStore:
    kwargs.setdefault("part_size", MIN_PART_SIZE)  # small parts: multipart with small blobs
    kwargs.setdefault("create_bucket", True)
    return S3BlobStore(
        bucket or f"test-{uuid.uuid4().hex}",
        endpoint_url=endpoint,
        region="us-east-1",
        path_style=True,
        **kwargs,
    )


class TestS3BlobStore(BlobStoreContract):
    @pytest.fixture
    def store(self, s3_endpoint: str) -> Iterator[S3BlobStore]:
        store = new_store(s3_endpoint)
        yield store
        store.close()

    def leftovers(self, store: BlobStore) -> list[str]:
        assert isinstance(store, S3BlobStore)
        return [u.key for u in store.list_open_uploads()]


def test_prefixes_are_isolated(s3_endpoint: str) -> None:
    bucket = f"test-{uuid.uuid4().hex}"
    a = new_store(s3_endpoint, bucket, prefix="env/a")
    b = new_store(s3_endpoint, bucket, prefix="/env/b/")
    root = new_store(s3_endpoint, bucket)
    a.put_stream("k", [b"in a"])
    b.put_stream("k", [b"in b"])
    assert a.get("k") == b"in a"
    assert b.get("k") == b"in b"
    assert list(a.iter_keys()) == ["k"]
    assert list(root.iter_keys()) == ["env/a/k", "env/b/k"]
    a.delete("k")
    assert b.exists("k")


def test_open_blob_store_s3_url(s3_endpoint: str) -> None:
    bucket = f"test-{uuid.uuid4().hex}"
    store = open_blob_store(
        f"s3://{bucket}/some/prefix",
        s3_endpoint_url=s3_endpoint,
        s3_region="us-east-1",
        s3_path_style=True,
        s3_create_bucket=True,
    )
    assert isinstance(store, S3BlobStore)
    assert (store.bucket, store.prefix) == (bucket, "some/prefix/")
    store.put_stream("k", [b"v"])
    assert list(new_store(s3_endpoint, bucket).iter_keys()) == ["some/prefix/k"]


def test_upload_streams_with_bounded_parts_in_flight(s3_endpoint: str) -> None:
    """Parts go up while the producer still produces, never more than max_concurrency at once,
    and the producer is held back so memory stays a few parts whatever the blob size."""
    store = new_store(s3_endpoint, max_concurrency=2)
    lock = threading.Lock()
    state = {"in_flight": 0, "max_in_flight": 0, "done": 0, "produced": 0}
    produced_at_first_part: list[int] = []
    ahead: list[int] = []

    def before(**_: Any) -> None:
        with lock:
            if not produced_at_first_part:
                produced_at_first_part.append(state["produced"])
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        time.sleep(0.05)  # a slow link: the producer must wait for it

    def after(**_: Any) -> None:
        with lock:
            state["in_flight"] -= 1
            state["done"] += 1

    events = store._client.meta.events
    events.register("before-call.s3.UploadPart", before)
    events.register("after-call.s3.UploadPart", after)

    data = os.urandom(40 * MiB)

    def produce() -> Iterator[bytes]:
        for piece in pieces(data, MiB):
            with lock:
                state["produced"] += len(piece)
                ahead.append(state["produced"] - state["done"] * store.part_size)
            yield piece

    assert store.put_stream("k", produce()) == len(data)
    assert store.get("k") == data
    assert state["max_in_flight"] == 2
    assert produced_at_first_part[0] < len(data) // 2
    # Bytes taken from the producer but not yet uploaded: parts in flight + the one filling.
    assert max(ahead) <= (2 + 1) * store.part_size + MiB


def test_failed_part_aborts_the_upload(s3_endpoint: str) -> None:
    from botocore.exceptions import EndpointConnectionError

    store = new_store(s3_endpoint)

    def fail_part_3(params: dict[str, Any], **_: Any) -> None:
        if params["PartNumber"] == 3:
            raise EndpointConnectionError(endpoint_url=s3_endpoint)

    store._client.meta.events.register("provide-client-params.s3.UploadPart", fail_part_3)
    data = os.urandom(30 * MiB)
    with pytest.raises(StorageUnavailable, match="upload part 3"):
        store.put_stream("k", pieces(data, MiB))
    assert not store.exists("k")
    assert store.list_open_uploads() == []


def test_abort_stale_uploads(s3_endpoint: str) -> None:
    store = new_store(s3_endpoint, prefix="svc")
    raw = boto3.session.Session().client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    mine = raw.create_multipart_upload(Bucket=store.bucket, Key="svc/runs/r/crashed.blob")
    raw.create_multipart_upload(Bucket=store.bucket, Key="elsewhere/x")
    raw.upload_part(
        Bucket=store.bucket,
        Key="svc/runs/r/crashed.blob",
        UploadId=mine["UploadId"],
        PartNumber=1,
        Body=b"x" * 100,
    )

    [open_upload] = store.list_open_uploads()
    assert open_upload.key == "runs/r/crashed.blob"
    assert open_upload.upload_id == mine["UploadId"]
    # moto reports every upload as initiated in 2010: measure the age rather than assume it.
    age = (datetime.now(UTC) - open_upload.initiated).total_seconds()
    assert store.abort_stale_uploads(older_than_s=age + 3600) == 0
    assert len(store.list_open_uploads()) == 1
    assert store.abort_stale_uploads(older_than_s=0) == 1
    assert store.list_open_uploads() == []
    assert not store.exists("runs/r/crashed.blob")
    others = raw.list_multipart_uploads(Bucket=store.bucket)["Uploads"]
    assert [u["Key"] for u in others] == ["elsewhere/x"]


@pytest.mark.timing
def test_unreachable_endpoint_fails_fast() -> None:
    t0 = time.monotonic()
    store = S3BlobStore(
        "some-bucket",
        "pre",
        endpoint_url="http://127.0.0.1:1",
        region="us-east-1",
        path_style=True,
        connect_timeout=0.5,
        read_timeout=0.5,
        max_attempts=1,
    )
    calls: list[Callable[[], object]] = [
        lambda: store.put_stream("k", [b"small"]),
        lambda: store.put_stream("k", pieces(b"x" * (6 * MiB), MiB)),
        lambda: store.get("k"),
        lambda: store.get("k", (0, 0)),
        lambda: store.exists("k"),
        lambda: store.delete("k"),
        lambda: list(store.iter_keys()),
        lambda: store.list_open_uploads(),
    ]
    for call in calls:
        with pytest.raises(StorageUnavailable) as info:
            call()
        assert "127.0.0.1:1" in str(info.value)
        assert "s3://some-bucket/pre/" in str(info.value)
        assert info.value.__cause__ is not None
    with pytest.raises(StorageUnavailable):
        S3BlobStore(
            "some-bucket",
            endpoint_url="http://127.0.0.1:1",
            create_bucket=True,
            connect_timeout=0.5,
            max_attempts=1,
        )
    assert time.monotonic() - t0 < 10


def test_missing_bucket_is_unavailable_not_missing_blob(s3_endpoint: str) -> None:
    store = new_store(s3_endpoint, create_bucket=False)
    with pytest.raises(StorageUnavailable, match="NoSuchBucket"):
        store.put_stream("k", [b"x"])
    with pytest.raises(StorageUnavailable, match=store.bucket):
        store.get("k")


def test_create_bucket_is_idempotent(s3_endpoint: str) -> None:
    first = new_store(s3_endpoint)
    first.put_stream("k", [b"v"])
    again = new_store(s3_endpoint, first.bucket)
    assert again.get("k") == b"v"


def test_no_credentials_is_unavailable(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
    ]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = new_store(s3_endpoint, "no-credentials-bucket", create_bucket=False)
    with pytest.raises(StorageUnavailable, match="credentials"):
        store.get("k")


def test_parameters_are_checked() -> None:
    with pytest.raises(ValueError):
        S3BlobStore("bucket", part_size=MiB)
    with pytest.raises(ValueError):
        S3BlobStore("bucket", max_concurrency=0)
    with pytest.raises(ValueError):
        S3BlobStore("", endpoint_url="http://127.0.0.1:1")
    with pytest.raises(ValueError):
        S3BlobStore("bucket", "a/../b")


def test_missing_boto3_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)
    monkeypatch.setitem(sys.modules, "boto3.session", None)
    with pytest.raises(ImportError, match=r"pip install 'ckptstore\[s3\]'"):
        S3BlobStore("bucket")


def test_empty_range_of_missing_blob(s3_endpoint: str) -> None:
    store = new_store(s3_endpoint)
    with pytest.raises(BlobNotFound):
        store.get("missing", (0, 0))


def test_a_presigned_upload_takes_about_32_parts_of_8_to_32_mib(s3_endpoint: str) -> None:
    # fewer, larger parts for large uploads: URLs signed, parts listed and completed, PUTs
    store = new_store(s3_endpoint, part_size=8 * MiB)
    assert store.presigned_part_size(100) == 8 * MiB
    assert store.presigned_part_size(256 * MiB) == 8 * MiB
    assert store.presigned_part_size(700 * MiB + 1) == 22 * MiB  # whole MiB, 32 parts
    assert store.presigned_part_size(1 << 30) == 32 * MiB
    assert store.presigned_part_size(10 << 30) == 32 * MiB  # then more parts
    key = "runs/r/1-" + "0" * 32 + ".1.presigned.blob"
    up = store.presigned_upload(key, (1 << 30) + 12345, 600)
    assert (up.part_size, len(up.urls)) == (32 * MiB, 33)
    first = os.urandom(up.part_size)
    put_part(up.urls[0], first, 30)
    put_part(up.urls[1], b"tail", 30)
    assert store.complete_presigned(key, up.upload_id, len(first) + 4) == len(first) + 4
    assert store.get(key) == first + b"tail"
