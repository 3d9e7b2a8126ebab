"""The parts sweep (maintenance/garbage.py: collect_parts) racing the uploads and commits it
must leave alone, on both databases. The sweep lists its candidates, then takes each part's
lock: whatever happened in between (the part finished, its checkpoint was committed) must
be seen under the lock, or the sweep deletes a finished part, or a committed one.

Each race is made deterministic by running the other side right after the sweep's listing
(a wrapper around the catalog call that lists).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptstore_core.errors import InvalidRequest
from ckptstore_service.catalog import Catalog
from ckptstore_service.maintenance.garbage import collect_parts
from ckptstore_service.storage import LocalBlobStore
from support.parts import finish_part_rows

RUN, STEP = "r", 1


@pytest.fixture
def store(tmp_path: Path) -> LocalBlobStore:
    return LocalBlobStore(tmp_path / "blobs")


def upload(catalog: Catalog, store: LocalBlobStore, name: str) -> tuple[int, str]:
    """Begin part ``name`` of ``RUN/STEP`` as an upload does: its ``writing`` row, then its
    durable blob; (checkpoint id, blob key)."""
    checkpoint_id = catalog.open_parts(catalog.ensure_run(RUN), STEP)
    key = f"runs/{RUN}/{STEP}-{name}.blob"
    catalog.begin_part(checkpoint_id, name, key)
    store.put_stream(key, [b"\1\2\3\4"])
    return checkpoint_id, key


def commit(catalog: Catalog, names: list[str]) -> None:
    catalog.commit_parts(
        RUN, STEP, names, parent_id=None, keyframe=True, since_keyframe=0, metadata={}
    )


def after_listing(catalog: Catalog, method: str, then: Callable[[], None]) -> None:
    """Make ``catalog.<method>()`` (a listing of the sweep's) run ``then()`` right after it
    listed: what another replica does between the sweep's listing and its part locks."""
    listing: Callable[..., Any] = getattr(catalog, method)

    def listed_then(*args: Any) -> Any:
        rows = listing(*args)
        then()
        return rows

    setattr(catalog, method, listed_then)


def test_a_part_that_finishes_after_the_listing_is_kept(
    catalog: Catalog, store: LocalBlobStore
) -> None:
    checkpoint_id, key = upload(catalog, store, "a")
    # the sweep lists "a" as writing; its upload finishes (and lets its lock go) meanwhile
    after_listing(
        catalog, "parts_in_progress", lambda: finish_part_rows(catalog, checkpoint_id, "a")
    )
    assert collect_parts(catalog, store, ttl_s=3600) == []
    part = catalog.find_part(checkpoint_id, "a")
    assert part is not None and part.status == "done" and store.exists(key)
    commit(catalog, ["a"])  # the coordinator's commit still finds it
    assert [t.name for t in catalog.tensors(catalog.get(RUN, STEP).id)] == ["a.w"]


def test_a_checkpoint_committed_after_the_listing_keeps_its_parts(
    catalog: Catalog, store: LocalBlobStore
) -> None:
    checkpoint_id, key = upload(catalog, store, "a")
    finish_part_rows(catalog, checkpoint_id, "a")
    # the sweep lists the checkpoint as abandoned (a TTL of 0); its commit comes meanwhile
    after_listing(catalog, "abandoned_parts", lambda: commit(catalog, ["a"]))
    assert collect_parts(catalog, store, ttl_s=0) == []
    info = catalog.get(RUN, STEP)
    assert info.parts == 1 and [t.name for t in catalog.tensors(info.id)] == ["a.w"]
    assert store.exists(key)


def test_an_abandoned_part_no_commit_may_take_once_the_sweep_claimed_it(
    catalog: Catalog, store: LocalBlobStore
) -> None:
    """The other order: the sweep collects an abandoned checkpoint's finished parts, and a
    commit after that fails (its parts are gone) rather than making a checkpoint whose
    blobs are deleted."""
    checkpoint_id, key = upload(catalog, store, "a")
    finish_part_rows(catalog, checkpoint_id, "a")
    assert [p.name for p in collect_parts(catalog, store, ttl_s=0)] == ["a"]
    assert not store.exists(key) and catalog.find_part(checkpoint_id, "a") is None
    with pytest.raises(InvalidRequest, match="no part of r/1 was uploaded"):
        commit(catalog, ["a"])


def test_an_abandoned_checkpoint_is_left_while_its_run_is_locked(
    catalog: Catalog, store: LocalBlobStore
) -> None:
    """A commit holds the run's lock from its look at the parts to its transaction's end:
    the sweep leaves the run's abandoned checkpoints to its next pass meanwhile."""
    checkpoint_id, key = upload(catalog, store, "a")
    finish_part_rows(catalog, checkpoint_id, "a")
    with catalog.run_lock(RUN):
        assert collect_parts(catalog, store, ttl_s=0) == []
    assert store.exists(key) and catalog.find_part(checkpoint_id, "a") is not None
    assert [p.name for p in collect_parts(catalog, store, ttl_s=0)] == ["a"]
