"""The base cache: newest checkpoint per run on disk, LRU within a byte budget."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from ckptstore_service.cache import BaseCache


def filled(cache: BaseCache, size: int, run: str = "other") -> Path:
    tmp = cache.new_file(run)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT)  # as the service does: overwrite, no truncate
    os.write(fd, os.urandom(size))
    os.close(fd)
    return tmp


def install(cache: BaseCache, run: str, checkpoint_id: int, size: int, **kw: object) -> None:
    cache.install(run, checkpoint_id, filled(cache, size, run), size, **kw)


def read(cache: BaseCache, run: str, checkpoint_id: int) -> bytes | None:
    fd = cache.open(run, checkpoint_id)
    if fd is None:
        return None
    try:
        return os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)


def test_newest_per_run_and_lru_eviction(tmp_path: Path) -> None:
    (tmp_path / "cache" / "slot-0").mkdir(parents=True)
    (tmp_path / "cache" / "slot-0" / "5.bin").write_bytes(b"from a previous process")
    (tmp_path / "cache" / "tmp").mkdir()  # the layout before slots
    (tmp_path / "cache" / "7.bin").write_bytes(b"from an older version")
    cache = BaseCache(tmp_path / "cache", max_bytes=2500)
    assert read(cache, "a", 5) is None  # not trusted: recycled as a spare file
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["slot-0"]
    a1 = filled(cache, 1000)
    data = a1.read_bytes()
    cache.install("a", 1, a1, 1000)
    assert read(cache, "a", 1) == data
    assert read(cache, "a", 2) is None  # keyed by checkpoint, not by run
    fd = cache.open("a", 1)  # a reader keeps its file even when replaced
    install(cache, "a", 2, 1000)
    assert fd is not None and os.pread(fd, 2000, 0) == data
    os.close(fd)
    assert read(cache, "a", 1) is None and read(cache, "a", 2) is not None
    install(cache, "b", 7, 1000)
    read(cache, "a", 2)  # a is now the most recently used
    install(cache, "c", 9, 1000)  # over budget: b goes
    assert read(cache, "b", 7) is None
    assert read(cache, "a", 2) is not None and read(cache, "c", 9) is not None
    install(cache, "d", 3, 3000)  # larger than the whole budget: not kept
    assert read(cache, "d", 3) is None
    assert list((cache.folder / "tmp").iterdir()) == []


def test_a_reader_does_not_replace_a_newer_base(tmp_path: Path) -> None:
    cache = BaseCache(tmp_path, max_bytes=10_000)
    seen = cache.current("r")
    assert seen is None
    install(cache, "r", 5, 100)  # a save lands while the reader decodes
    install(cache, "r", 4, 100, if_current=seen)
    assert cache.current("r") == 5
    install(cache, "r", 6, 100, if_current=5)
    assert cache.current("r") == 6
    assert len(list((cache.folder / "tmp").iterdir())) == 1  # 5's file, kept as r's spare


def test_replaced_files_are_recycled_unless_a_reader_holds_them(tmp_path: Path) -> None:
    cache = BaseCache(tmp_path, max_bytes=10_000)
    install(cache, "r", 1, 3000)
    first = os.stat(cache.folder / "1.bin").st_ino
    install(cache, "r", 2, 3000)
    spare = cache.new_file("r")  # 1's file, its pages still cached: overwritten in place
    assert os.stat(spare).st_ino == first
    fd = os.open(spare, os.O_WRONLY)
    os.write(fd, b"x" * 1000)  # shorter than before: install cuts the stale tail
    os.close(fd)
    cache.install("r", 3, spare, 1000)
    assert read(cache, "r", 3) == b"x" * 1000

    reader = cache.open("r", 3)  # a load streaming checkpoint 3 ...
    assert reader is not None
    install(cache, "r", 4, 500)  # ... while 4 and 5 are saved
    fresh = cache.new_file("r")
    assert not fresh.exists()  # 3's file is still being read: not reused
    assert os.pread(reader, 2000, 0) == b"x" * 1000
    os.close(reader)


def test_spares_count_against_the_budget(tmp_path: Path) -> None:
    cache = BaseCache(tmp_path, max_bytes=2500)
    install(cache, "a", 1, 1000)
    install(cache, "a", 2, 1000)  # 1 becomes a's spare: 2000 bytes on disk
    install(cache, "b", 3, 1000)  # over budget: the spare goes before any run's base
    assert read(cache, "a", 2) is not None and read(cache, "b", 3) is not None
    assert list((cache.folder / "tmp").iterdir()) == []


def test_processes_sharing_the_folder_each_get_their_own_slot(tmp_path: Path) -> None:
    first = BaseCache(tmp_path, max_bytes=10_000)
    install(first, "a", 1, 100)
    files = sorted(p.name for p in first.folder.rglob("*"))
    second = BaseCache(tmp_path, max_bytes=10_000)  # e.g. a replica scaled out on one volume
    assert second.folder != first.folder
    install(second, "a", 1, 100)
    assert sorted(p.name for p in first.folder.rglob("*")) == files  # untouched
    assert read(first, "a", 1) is not None and read(second, "a", 1) is not None
    first.close()
    third = BaseCache(tmp_path, max_bytes=10_000)  # a restart takes the free slot
    assert third.folder == first.folder
    second.close()
    third.close()


def test_files_left_by_an_earlier_process_are_recycled_not_trusted(tmp_path: Path) -> None:
    first = BaseCache(tmp_path, max_bytes=10_000)
    install(first, "a", 1, 1000)
    install(first, "a", 2, 1000)  # checkpoint 1's file is now the run's spare
    files = [p for p in first.folder.rglob("*") if p.is_file() and p.name != ".lock"]
    inodes = {p.stat().st_ino for p in files}
    assert len(inodes) == 2
    first.close()

    second = BaseCache(tmp_path, max_bytes=10_000)
    assert read(second, "a", 2) is None  # contents are not trusted across processes
    reused = {second.new_file(run).stat().st_ino for run in ("x", "y")}
    assert reused == inodes  # both files are overwritten in place by the next fills
    assert not second.new_file("z").exists()  # then fresh names
    second.close()

    third = BaseCache(tmp_path, max_bytes=1500)  # over the budget: orphans are deleted
    assert sum(1 for p in (third.folder / "tmp").iterdir()) <= 1
    third.close()


def test_files_in_slots_no_process_holds_are_deleted(tmp_path: Path) -> None:
    live = BaseCache(tmp_path, max_bytes=10_000)  # slot-0, held
    install(live, "a", 1, 100)
    kept = sorted(p.name for p in live.folder.rglob("*"))
    dead = tmp_path / "slot-3"  # a replica since scaled down
    (dead / "tmp").mkdir(parents=True)
    (dead / "9.bin").write_bytes(b"x" * 500)
    (dead / "tmp" / "spare").write_bytes(b"y" * 500)
    other = BaseCache(tmp_path, max_bytes=10_000)
    assert other.folder.name == "slot-1"
    assert [p.name for p in dead.iterdir()] == [".lock"]
    assert sorted(p.name for p in live.folder.rglob("*")) == kept
    other.close()
    live.close()


def test_a_save_takes_its_base_to_overwrite_unless_another_reader_holds_it(
    tmp_path: Path,
) -> None:
    cache = BaseCache(tmp_path, max_bytes=10_000)
    install(cache, "r", 1, 1000)
    inode = os.stat(cache.folder / "1.bin").st_ino
    base = cache.open("r", 1)  # the save reads its base through this
    other = cache.open("r", 1)  # a load of latest, still streaming
    assert base is not None and other is not None
    old = os.pread(base, 2000, 0)
    assert cache.take("r", 1, base) is None  # the load would read the new bytes
    assert read(cache, "r", 1) == old  # still cached
    os.close(other)
    probe = os.open(cache.folder / "1.bin", os.O_RDONLY)
    with pytest.raises(BlockingIOError):  # the failed take left ``base`` its shared lock
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(probe)
    assert cache.take("r", 2, base) is None  # not the cached checkpoint
    path = cache.take("r", 1, base)
    assert path is not None and os.stat(path).st_ino == inode
    assert cache.open("r", 1) is None  # out of the cache: later loads miss
    assert os.pread(base, 2000, 0) == old
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, b"y" * 800, 0)
    os.close(fd)
    os.close(base)
    cache.install("r", 2, path, 800)
    assert read(cache, "r", 2) == b"y" * 800
    assert os.stat(cache.folder / "2.bin").st_ino == inode
    assert list((cache.folder / "tmp").iterdir()) == []  # one file for the run, no spare
