"""The clean-up of a save that failed after its blob was finished (in process: SQLite + local
folder, with the store and the catalog made to fail where a real outage would)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ckptstore_core.errors import StorageUnavailable
from ckptstore_core.wire import FORMAT, encode_header
from ckptstore_service.runtime import Runtime
from ckptstore_service.settings import Settings


def test_a_blob_that_cannot_be_deleted_keeps_its_row_for_the_start_up_collection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the commit fails after the blob is durable, and the store refuses its delete: the
    # clean-up went on to delete the ``writing`` row, the only thing that named the blob,
    # which then stayed in the store for good
    prefix, _ = encode_header([("w", "F32", (1000,))], {"format": FORMAT})
    body = prefix + np.arange(1000, dtype=np.float32).tobytes()

    def refuse(*args: object, **kwargs: object) -> None:
        raise StorageUnavailable("refused")

    rt = Runtime.open(Settings(data_dir=tmp_path))
    try:
        monkeypatch.setattr(rt.catalog, "commit_upload", refuse)
        monkeypatch.setattr(rt.store, "delete", refuse)
        with pytest.raises(StorageUnavailable, match="refused"):
            rt.saver.ingest("r", 1, [body], len(body))
        blobs = list(rt.store.iter_keys())
        assert len(blobs) == 1
        assert [key for _, _, key, _ in rt.catalog.uploads_in_progress()] == blobs
    finally:
        monkeypatch.undo()
        rt.close()
    rt = Runtime.open(Settings(data_dir=tmp_path))  # start-up collects both
    try:
        assert list(rt.store.iter_keys()) == []
        assert rt.catalog.uploads_in_progress() == []
    finally:
        rt.close()
