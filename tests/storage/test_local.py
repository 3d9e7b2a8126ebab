from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore_core.errors import StorageUnavailable
from ckptstore_service.storage import BlobStore, LocalBlobStore, local
from ckptstore_service.storage.local import _tmp_prefix

from .contract import BlobStoreContract


class TestLocalBlobStore(BlobStoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> LocalBlobStore:
        return LocalBlobStore(tmp_path / "blobs")

    def leftovers(self, store: BlobStore) -> list[str]:
        assert isinstance(store, LocalBlobStore)
        return sorted(os.listdir(store.root / ".tmp"))


def test_layout(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    store.put_stream("runs/r/1.blob", [b"abc"])
    assert (tmp_path / "runs" / "r" / "1.blob").read_bytes() == b"abc"
    assert os.listdir(tmp_path / ".tmp") == []


def test_collect_temp_removes_only_stale_files(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    stale = tmp_path / ".tmp" / "crashed.part"
    fresh = tmp_path / ".tmp" / "writing.part"
    stale.write_bytes(b"half a blob")
    fresh.write_bytes(b"in progress")
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))

    assert store.collect_temp(older_than_s=600) == 1
    assert not stale.exists()
    assert fresh.exists()
    assert store.collect_temp(older_than_s=0) == 1
    assert os.listdir(tmp_path / ".tmp") == []


def test_temp_files_are_not_keys(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    (tmp_path / ".tmp" / "orphan.part").write_bytes(b"x")
    store.put_stream("k", [b"v"])
    assert list(store.iter_keys()) == ["k"]
    assert list(store.iter_keys(".")) == []
    assert list(store.iter_keys(".tmp/")) == []


@pytest.mark.parametrize("key", ["../x", "../../etc/passwd", ".tmp/x", ".tmp"])
def test_keys_cannot_leave_the_root(tmp_path: Path, key: str) -> None:
    store = LocalBlobStore(tmp_path / "root")
    with pytest.raises(ValueError):
        store.put_stream(key, [b"x"])
    with pytest.raises(ValueError):
        store.get(key)
    assert sorted(os.listdir(tmp_path)) == ["root"]


def test_symlink_out_of_root_is_rejected(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    store = LocalBlobStore(tmp_path / "root")
    (tmp_path / "root" / "evil").symlink_to(outside)
    with pytest.raises(ValueError):
        store.put_stream("evil/x", [b"x"])
    assert os.listdir(outside) == []


def test_directories_are_not_blobs(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    store.put_stream("runs/r/1", [b"x"])
    assert not store.exists("runs/r")
    from ckptstore_service.storage import BlobNotFound

    with pytest.raises(BlobNotFound):
        store.get("runs/r")
    store.delete("runs/r")
    assert store.get("runs/r/1") == b"x"


def test_abort_incomplete_finds_a_dead_writers_temp_file(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    seen: list[str] = []

    def crash_midway() -> Iterator[bytes]:
        yield b"partial"
        seen.extend(os.listdir(tmp_path / ".tmp"))
        yield b"more"

    store.put_stream("runs/r/x.blob", crash_midway())
    assert len(seen) == 1 and seen[0].startswith(_tmp_prefix("runs/r/x.blob"))
    # a SIGKILL leaves such files behind: recreate two, one per writer
    dead = tmp_path / ".tmp" / (_tmp_prefix("runs/r/dead.blob") + "a.part")
    live = tmp_path / ".tmp" / (_tmp_prefix("runs/r/live.blob") + "b.part")
    dead.write_bytes(b"partial")
    live.write_bytes(b"in progress")
    assert store.abort_incomplete(["runs/r/dead.blob"]) == 1
    assert not dead.exists() and live.exists()
    assert store.abort_incomplete([], older_than_s=0) == 1
    assert not live.exists()


def test_readiness_fails_while_the_folder_is_gone_and_recovers(tmp_path: Path) -> None:
    """A blob folder that disappeared (an unmounted volume) or became a file is not ready
    (writable-by-mode checks would pass as root: the probe really writes a file)."""
    store = LocalBlobStore(tmp_path / "blobs")
    store.check_ready()
    (tmp_path / "blobs").rename(tmp_path / "away")
    (tmp_path / "blobs").write_bytes(b"not a folder")
    with pytest.raises(StorageUnavailable, match="not writable"):
        store.check_ready()
    (tmp_path / "blobs").unlink()
    (tmp_path / "away").rename(tmp_path / "blobs")
    store.check_ready()
    assert os.listdir(tmp_path / "blobs" / ".tmp") == []


def _kept_after_a_blob(store: LocalBlobStore) -> list[object]:
    """The direct buffers kept once a blob is written (skips where there are none: a
    filesystem without O_DIRECT, whose blobs go through the page cache)."""
    store.put_stream("warm", [b"w" * 5000])
    kept = list(local._BUFFERS._free)
    if not kept:
        pytest.skip("this filesystem has no O_DIRECT")
    return kept


def test_a_blob_written_leaves_its_direct_buffer_to_the_next(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    first = [os.urandom(5 << 20), b"tail"]  # more than one buffer's worth, and a tail
    store.put_stream("a", first)
    kept = _kept_after_a_blob(store)
    store.put_stream("b", [b"x" * 10_000])  # in a kept buffer, full of earlier bytes
    assert local._BUFFERS._free[-1] in kept
    assert store.get("a") == b"".join(first)
    assert store.get("b") == b"x" * 10_000  # the earlier bytes did not leak in


def test_a_failed_blob_does_not_hand_its_buffer_on(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    kept = _kept_after_a_blob(store)

    def failing() -> Iterator[bytes]:
        yield b"y" * 5000
        raise RuntimeError("the producer failed")

    with pytest.raises(RuntimeError, match="producer failed"):
        store.put_stream("c", failing())
    assert len(local._BUFFERS._free) == len(kept) - 1  # taken, and unmapped with its error


def test_direct_buffers_kept_are_bounded() -> None:
    pool = local._DirectBuffers(keep=1)
    a, b = pool.take(), pool.take()
    pool.give_back(a)
    pool.give_back(b)  # over the bound: unmapped
    assert b.closed and not a.closed
    assert pool.take() is a


def test_a_forked_childs_direct_buffers_are_its_own() -> None:
    pool = local._DirectBuffers(keep=1)
    buf = pool.take()
    buf[:5] = b"PARNT"
    pid = os.fork()
    if pid == 0:  # the child writes into its copy, then leaves at once
        buf[:5] = b"CHILD"
        os._exit(0)
    os.waitpid(pid, 0)
    assert buf[:5] == b"PARNT"
