from __future__ import annotations

from pathlib import Path

import pytest

from ckptstore_service.storage import LocalBlobStore, open_blob_store


def test_file_url(tmp_path: Path) -> None:
    store = open_blob_store(f"file://{tmp_path}/blobs")
    assert isinstance(store, LocalBlobStore)
    assert store.root == tmp_path / "blobs"


def test_plain_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_blob_store(str(tmp_path / "a"))
    assert isinstance(store, LocalBlobStore) and store.root == tmp_path / "a"
    monkeypatch.chdir(tmp_path)
    store = open_blob_store("rel/dir")
    assert isinstance(store, LocalBlobStore) and store.root == tmp_path / "rel" / "dir"


def test_file_url_with_quoted_chars(tmp_path: Path) -> None:
    store = open_blob_store(f"file://{tmp_path}/with%20space")
    assert isinstance(store, LocalBlobStore) and store.root == tmp_path / "with space"


@pytest.mark.parametrize(
    "url",
    [
        "",
        "http://example.com/x",
        "gs://bucket/x",
        "file://host/x",
        "file:relative",
        "s3://",
        "s3:///prefix",
        "s3://bucket/x?region=eu",
    ],
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ValueError, match=r"file:///absolute/path|s3://bucket|query"):
        open_blob_store(url)
