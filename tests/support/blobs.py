"""What a local blob store holds, and what a SQLite catalog names: a test compares the two
after a collection with grace 0 (nothing orphaned, nothing lost)."""

from __future__ import annotations

import sqlite3
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import create_engine, text

from ckptstore import CheckpointClient
from support.serviceproc import Service, wait_idle
from support.waiting import poll

__all__ = ["blob_files", "catalog_blobs", "check_store", "garbage_blobs", "named_blobs"]

NAMED_BLOBS = "SELECT blob_key FROM checkpoints UNION SELECT blob_key FROM parts"


def blob_files(data_dir: Path) -> dict[str, int]:
    """Every blob in the service's local store (``<data_dir>/blobs``) and its size, partial
    writes left out. A blob the service deletes while it is listed is not in it (a test
    that polls this during a collection must not fail on the race)."""
    root = data_dir / "blobs"
    found: dict[str, int] = {}
    for p in root.rglob("*.blob"):
        key = p.relative_to(root)
        if key.parts[0] == "tmp":
            continue
        try:
            info = p.stat()
        except FileNotFoundError:  # collected between the listing and now
            continue
        if stat.S_ISREG(info.st_mode):
            found[str(key)] = info.st_size
    return found


def catalog_blobs(db_file: Path) -> set[str]:
    """The blobs that rows of the SQLite catalog ``db_file`` name: checkpoints' and parts'."""
    with sqlite3.connect(db_file) as db:
        return {k for (k,) in db.execute(NAMED_BLOBS) if k}


def named_blobs(database_url: str) -> set[str]:
    """The blobs that rows of the catalog at ``database_url`` (PostgreSQL, say) name:
    checkpoints' and parts'."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as db:
            return {k for (k,) in db.execute(text(NAMED_BLOBS)) if k}
    finally:
        engine.dispose()


def garbage_blobs(db_file: Path) -> set[str]:
    """The blobs on the SQLite catalog's garbage table."""
    with sqlite3.connect(db_file) as db:
        return {k for (k,) in db.execute("SELECT blob_key FROM garbage")}


def check_store(svc: Service, client: CheckpointClient, timeout: float = 30.0) -> int:
    """Once the service (SQLite + local folder) collected its garbage (grace 0): the blob
    folder holds exactly the blobs the catalog names, as many bytes as the listings say.
    Returns that total. The run's pass collects its garbage (``wait_idle``); a pass that
    found the run's re-root lock taken leaves it to the next sweep, which the check waits
    for (``timeout``: set ``CKPTSTORE_SWEEP_INTERVAL_S`` below it)."""
    wait_idle(svc.url)
    db = svc.data_dir / "catalog.sqlite3"

    def settled() -> bool:
        return set(blob_files(svc.data_dir)) == catalog_blobs(db) and not garbage_blobs(db)

    poll(settled, timeout, interval=0.2)
    files = blob_files(svc.data_dir)
    named = catalog_blobs(db)
    assert set(files) == named, (
        f"blobs no row names: {sorted(set(files) - named)}; "
        f"named but missing: {sorted(named - set(files))}; "
        f"on the garbage table: {sorted(garbage_blobs(db))}; "
        f"the service's log ends with:\n{svc.log.read_text()[-3000:]}"
    )
    assert not garbage_blobs(db)
    stored = sum(r.stored_bytes for r in client.runs())
    assert sum(files.values()) == stored
    return stored


def collect_all(data: Path) -> None:
    """With the service of ``data`` (SQLite + local folder) stopped: collect every blob on
    its garbage table, those of an interrupted rewrite included (named before they exist,
    due once a crashed upload's time is over: collected as then)."""
    from ckptstore_service.catalog import Catalog
    from ckptstore_service.maintenance import collect_garbage
    from ckptstore_service.settings import Settings
    from ckptstore_service.storage import open_blob_store

    settings = Settings(data_dir=data)
    catalog = Catalog(settings.resolved_database_url())
    store = open_blob_store(settings.resolved_blob_url())
    try:
        later = datetime.now(UTC) + timedelta(seconds=settings.incomplete_upload_ttl_s + 1)
        collect_garbage(catalog, store, None, now=later)
    finally:
        store.close()
        catalog.close()
