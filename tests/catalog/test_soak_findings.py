"""Two faults the soak (bench/soak.py, issue 21 item 8) found, each made deterministic here
(both fixed: each test failed before its fix).

1. The start-up collection of crashed uploads deletes the blob of a save that committed
   after the collection listed its ``writing`` row: it lists the rows once, then takes each
   row's run lock and deletes its blob without looking again whether the row is still
   ``writing``; ``abort_upload`` then keeps the committed row, which names a missing blob.
   In a 30-minute soak a replica restarted while the other saved, and a later load of that
   step answered ``500 blob_not_found``.
2. ``LeaseLocks.renew`` (the heartbeat) marks a lock lost, and logs an ERROR saying that its
   lease expired and another writer took it over, when it runs while a thread of the same
   process is still taking a lock (``_take`` registers the lease before its INSERT commits).
   Nothing was lost: the soak logged dozens of such ERRORs with a 15 s lease, seconds after
   the locks were taken, and a lock that is then taken carries ``lost`` although it holds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from ckptstore_service.catalog import Catalog
from ckptstore_service.catalog.db import Database
from ckptstore_service.catalog.locks import LeaseLocks, Purpose
from ckptstore_service.maintenance import collect_crashed_uploads
from ckptstore_service.names import blob_key
from ckptstore_service.storage.local import LocalBlobStore


def test_the_crash_collection_keeps_the_blob_of_a_save_that_committed_since_its_listing(
    catalog: Catalog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    run_id = catalog.ensure_run("r")
    key = blob_key("r", 1)
    with catalog.run_lock("r") as lease:  # a save, on one replica
        checkpoint_id = catalog.begin_upload(run_id, 1, key)
        size = store.put_stream(key, [b"x" * 100])
        listed = catalog.uploads_in_progress()  # another replica starts: its collector lists
        catalog.commit_upload(
            checkpoint_id,
            parent_id=None,
            keyframe=True,
            chain_depth=0,
            since_keyframe=0,
            raw_bytes=0,
            stored_bytes=size,
            metadata={},
            tensors=[],
            chunks=[],
            fence=lease,
        )
    # the save answered and released the lock; the collector reaches the row it listed
    monkeypatch.setattr(catalog, "uploads_in_progress", lambda: listed)
    collect_crashed_uploads(catalog, store, 86400)
    assert catalog.find("r", 1) is not None
    assert store.exists(key), "a committed checkpoint's blob was collected as a crashed upload"


@pytest.mark.postgres
def test_a_renewal_while_a_lock_is_being_taken_loses_nothing(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    Catalog(pg_url).upgrade()
    db = Database(pg_url)
    locks = LeaseLocks(db, None, lease_s=60.0)  # nothing can expire in this test
    real = db.session
    renewing = False

    @contextmanager
    def session() -> Iterator[Session]:
        """The heartbeat's renewal runs just before the take's INSERT, as it may."""
        nonlocal renewing
        if not renewing:
            renewing = True
            locks.renew()
        with real() as s:
            yield s

    db.session = session  # type: ignore[method-assign]
    try:
        with (
            caplog.at_level(logging.ERROR, logger="ckptstore"),
            locks.hold(Purpose.RUN, "r") as lease,
        ):
            assert lease is not None
            assert lease.lost is None, lease.lost
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        locks.close()
        db.close()
