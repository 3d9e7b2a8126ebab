"""The base cache: newest checkpoint per run on disk, LRU within a byte budget."""

from __future__ import annotations

import os
from pathlib import Path

from ckptstore_service.cache import BaseCache


def filled(cache: BaseCache, size: int) -> Path:
    tmp = cache.new_file()
    tmp.write_bytes(os.urandom(size))
    return tmp


def read(cache: BaseCache, run: str, checkpoint_id: int) -> bytes | None:
    fd = cache.open(run, checkpoint_id)
    if fd is None:
        return None
    try:
        return os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)


def test_newest_per_run_and_lru_eviction(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "stale.bin").write_bytes(b"from a previous process")
    cache = BaseCache(tmp_path / "cache", max_bytes=2500)
    assert not (tmp_path / "cache" / "stale.bin").exists()  # wiped at start-up
    a1 = filled(cache, 1000)
    data = a1.read_bytes()
    cache.install("a", 1, a1)
    assert read(cache, "a", 1) == data
    assert read(cache, "a", 2) is None  # keyed by checkpoint, not by run
    fd = cache.open("a", 1)  # a reader keeps its file even when replaced
    cache.install("a", 2, filled(cache, 1000))
    assert fd is not None and os.pread(fd, 2000, 0) == data
    os.close(fd)
    assert read(cache, "a", 1) is None and read(cache, "a", 2) is not None
    cache.install("b", 7, filled(cache, 1000))
    read(cache, "a", 2)  # a is now the most recently used
    cache.install("c", 9, filled(cache, 1000))  # over budget: b goes
    assert read(cache, "b", 7) is None
    assert read(cache, "a", 2) is not None and read(cache, "c", 9) is not None
    cache.install("d", 3, filled(cache, 3000))  # larger than the whole budget: not kept
    assert read(cache, "d", 3) is None
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []


def test_a_reader_does_not_replace_a_newer_base(tmp_path: Path) -> None:
    cache = BaseCache(tmp_path, max_bytes=10_000)
    seen = cache.current("r")
    assert seen is None
    cache.install("r", 5, filled(cache, 100))  # a save lands while the reader decodes
    cache.install("r", 4, filled(cache, 100), if_current=seen)
    assert cache.current("r") == 5
    cache.install("r", 6, filled(cache, 100), if_current=5)
    assert cache.current("r") == 6
    assert list((tmp_path / "tmp").iterdir()) == []
