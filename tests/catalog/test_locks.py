"""The run-lock contract on each backend (PostgreSQL leases, flock, thread locks), what each
backend adds to it, and which one a catalog picks. Fencing: tests/catalog/test_fencing.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lock_contract import REROOT, RUN, RunLocksContract, free

from ckptstore_service.catalog import Catalog
from ckptstore_service.catalog.db import Database
from ckptstore_service.catalog.locks import FileLocks, LeaseLocks, RunLocks, ThreadLocks

LEASE_S = 2.0  # short: a holder that dies releases its locks this long after


@pytest.mark.postgres
class TestLeaseLocks(RunLocksContract):
    @pytest.fixture
    def url(self, pg_url: str) -> str:
        Catalog(pg_url).upgrade()
        return pg_url

    @pytest.fixture
    def locks(self, url: str) -> Iterator[RunLocks]:
        locks = LeaseLocks(Database(url), None, LEASE_S)
        yield locks
        locks.close()

    @pytest.fixture
    def other(self, url: str) -> Iterator[RunLocks]:
        other = LeaseLocks(Database(url), None, LEASE_S)
        yield other
        other.close()

    @pytest.fixture(autouse=True)
    def _remember_url(self, url: str) -> None:
        self._url = url

    def constructor(self) -> str:
        return (
            "LeaseLocks(__import__('ckptstore_service.catalog.db').catalog.db"
            f".Database({self._url!r}), None, {LEASE_S})"
        )


class TestFileLocks(RunLocksContract):
    @pytest.fixture
    def folder(self, tmp_path: Path) -> Path:
        self._folder = tmp_path / "catalog.sqlite3.locks"
        return self._folder

    @pytest.fixture
    def locks(self, folder: Path) -> RunLocks:
        return FileLocks(folder)

    @pytest.fixture
    def other(self, folder: Path) -> RunLocks:
        return FileLocks(folder)

    def constructor(self) -> str:
        return f"FileLocks(Path({str(self._folder)!r}))"


class TestThreadLocks(RunLocksContract):
    @pytest.fixture
    def locks(self) -> RunLocks:
        return ThreadLocks()


def test_file_locks_lie_beside_the_database(tmp_path: Path) -> None:
    locks = FileLocks(tmp_path / "locks")
    with locks.hold(RUN, "r"), locks.hold(REROOT, "r"):
        assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.lock")) == [
            "locks/r.lock",  # where a run's lock always was
            "locks/reroot/r.lock",
        ]
    # a file lives only while its lock is held: nothing piles up per run, part or step
    with locks.hold(RUN, "r", blocking=False) as held:
        assert held
    assert not list(tmp_path.rglob("*.lock"))


def test_file_locks_exclude_while_their_files_come_and_go(tmp_path: Path) -> None:
    """Holders unlink their file as they release: threads (each its own open file, as
    processes are) taking one lock, blocking and not, never hold it two at a time."""
    import threading
    import time

    locks = FileLocks(tmp_path / "locks")
    inside = []
    most = [0]
    guard = threading.Lock()

    def work(blocking: bool) -> None:
        for _ in range(200):
            with locks.hold(RUN, "shared", blocking=blocking) as held:
                if not held:
                    continue
                with guard:
                    inside.append(1)
                    most[0] = max(most[0], len(inside))
                time.sleep(0.0002)  # widens the window a second holder would show in
                with guard:
                    inside.pop()

    threads = [threading.Thread(target=work, args=(i % 2 == 0,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
    assert not list(tmp_path.rglob("*.lock"))


@pytest.mark.parametrize("run", ["", ".", "..", "a/b", "../r", "r\0"])
def test_file_locks_refuse_a_name_that_is_no_file_name(tmp_path: Path, run: str) -> None:
    with pytest.raises(ValueError, match="file name"), FileLocks(tmp_path).hold(RUN, run):
        pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("sqlite:///{tmp}/catalog.sqlite3", FileLocks),
        ("sqlite://", ThreadLocks),
        ("sqlite:///:memory:", ThreadLocks),
        pytest.param("postgres", LeaseLocks, marks=pytest.mark.postgres),
    ],
)
def test_a_catalog_picks_the_locks_of_its_database(
    request: pytest.FixtureRequest, tmp_path: Path, url: str, kind: type[RunLocks]
) -> None:
    if url == "postgres":
        url = request.getfixturevalue("pg_url")
    catalog = Catalog(url.format(tmp=tmp_path))
    try:
        assert isinstance(catalog._locks, kind)
        if kind is not ThreadLocks:
            catalog.upgrade()  # their leases are rows
        # the facade's two locks are the two purposes of one run
        with catalog.run_lock("r") as held:
            assert held
            with catalog.reroot_lock("r", blocking=False) as also:
                assert also
                assert not free(catalog._locks, RUN, "r")
                assert not free(catalog._locks, REROOT, "r")
    finally:
        catalog.close()
