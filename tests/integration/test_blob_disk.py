"""The local blob folder full or read-only: a save fails with a clear 503, leaves nothing
behind (no ``writing`` row, no held disk space, no cache file), and the service keeps serving.

Each test mounts a small tmpfs as the blob folder, so it needs root (skipped otherwise).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointClient, StorageUnavailable
from ckptstore.state import tensor_bytes
from ckptstore_core.wire import FORMAT, encode_header
from ckptstore_service.storage.local import LocalBlobStore
from support.bodies import partial_upload
from support.serviceproc import Service
from support.states import assert_same_state
from support.waiting import wait_until

MiB = 1 << 20


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``tmpfs(size)`` mounts a tmpfs of ``size`` bytes; all are unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        path = tmp_path / f"tmpfs{len(mounted)}"
        path.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def catalog_rows(data_dir: Path) -> list[tuple[int, str]]:
    db = sqlite3.connect(data_dir / "catalog.sqlite3")
    try:
        return sorted(db.execute("SELECT step, status FROM checkpoints").fetchall())
    finally:
        db.close()


def test_a_write_that_fills_the_disk_frees_what_it_wrote(tmpfs: Callable[[int], Path]) -> None:
    # the O_DIRECT buffer's close raised BufferError (a slice of it lived on in the ENOSPC
    # traceback), which hid the StorageUnavailable and leaked the temp file's descriptor:
    # its blocks stayed allocated and the disk stayed full until a restart
    root = tmpfs(6 * MiB)  # the second 4 MiB write is cut short, the third refused
    store = LocalBlobStore(root)
    piece = os.urandom(MiB)
    with pytest.raises(StorageUnavailable, match="No space left"):
        store.put_stream("big", (piece for _ in range(16)))
    assert used(root) < MiB
    assert list(store.iter_keys()) == [] and os.listdir(root / ".tmp") == []
    assert store.put_stream("small", [piece]) == MiB


@pytest.mark.slow
def test_a_full_blob_disk_fails_the_save_and_the_service_goes_on(
    make_service: Callable[..., Service], tmpfs: Callable[[int], Path], tmp_path: Path
) -> None:
    blobs = tmpfs(20 * MiB)
    data_dir = tmp_path / "data"
    svc = make_service({"CKPTSTORE_BLOB_URL": f"file://{blobs}"}, data_dir)
    g = torch.Generator().manual_seed(0)
    small = {"w": torch.randn(100_000, generator=g)}
    big = {"w": torch.randn(8_000_000, generator=g)}  # 32 MB of noise: does not compress
    with CheckpointClient(svc.url, retries=0) as client:
        client.save("full", 1, small)
        for step in (2, 3):
            with pytest.raises(StorageUnavailable, match="No space left") as info:
                client.save("full", step, big)
            assert info.value.status == 503
        assert used(blobs) < 2 * MiB  # nothing of the failed saves holds the disk
        assert [c.step for c in client.list("full")] == [1]
        assert catalog_rows(data_dir) == [(1, "committed")]
        assert_same_state(small, client.load("full"))
        nxt = {"w": small["w"] + 1}
        client.save("full", 2, nxt)  # the disk has room again
        assert_same_state(small, client.load("full", 1))
        assert_same_state(nxt, client.load("full"))


@pytest.mark.slow
def test_a_read_only_blob_disk_fails_the_save_with_its_own_error(
    make_service: Callable[..., Service], tmpfs: Callable[[int], Path], tmp_path: Path
) -> None:
    blobs = tmpfs(50 * MiB)
    data_dir = tmp_path / "data"
    svc = make_service({"CKPTSTORE_BLOB_URL": f"file://{blobs}"}, data_dir)
    cache_tmp = data_dir / "cache" / "slot-0" / "tmp"
    w = torch.randn(300_000, generator=torch.Generator().manual_seed(1))
    with CheckpointClient(svc.url, retries=0) as client:
        client.save("ro", 1, {"w": w})
        remount(blobs, "ro")
        try:
            # the clean-up's failure to delete the blob that was never written replaced the
            # real error, and skipped the rest of the clean-up: the ``writing`` row, the taken
            # base cache file and two descriptors stayed behind
            with pytest.raises(StorageUnavailable, match=r"temp file.*Read-only") as info:
                client.save("ro", 2, {"w": w + 1})
            assert info.value.status == 503
            assert catalog_rows(data_dir) == [(1, "committed")]
            assert os.listdir(cache_tmp) == []
            assert_same_state({"w": w}, client.load("ro"))
        finally:
            remount(blobs, "rw")
        client.save("ro", 2, {"w": w + 1})
        assert_same_state({"w": w}, client.load("ro", 1))
        assert_same_state({"w": w + 1}, client.load("ro"))


@pytest.mark.slow
def test_a_service_starts_on_a_read_only_blob_disk_with_a_crashed_upload(
    make_service: Callable[..., Service], tmpfs: Callable[[int], Path], tmp_path: Path
) -> None:
    # the start-up collection of the crashed upload's temp file raised EROFS and the service
    # refused to start, so it could not even serve the checkpoints it had
    blobs = tmpfs(50 * MiB)
    data_dir = tmp_path / "data"
    env = {"CKPTSTORE_BLOB_URL": f"file://{blobs}"}
    svc = make_service(env, data_dir)
    w = torch.randn(1 << 20, generator=torch.Generator().manual_seed(2))
    with CheckpointClient(svc.url, retries=0) as client:
        client.save("crash", 1, {"w": w})
    prefix, header = encode_header([("w", "F32", (1 << 20,))], {"format": FORMAT})
    body = prefix + bytes(tensor_bytes(w + 1))[: 3 * MiB]
    sock = partial_upload(svc.url, "crash", 2, body, header.total_len)
    wait_until(lambda: os.listdir(blobs / ".tmp"), what="the upload's blob was begun")
    svc.kill()
    sock.close()
    assert catalog_rows(data_dir) == [(1, "committed"), (2, "writing")]
    remount(blobs, "ro")
    try:
        svc = make_service(env, data_dir)
        with CheckpointClient(svc.url, retries=0) as client:
            assert_same_state({"w": w}, client.load("crash"))
        svc.stop()
    finally:
        remount(blobs, "rw")
    svc = make_service(env, data_dir)  # now the crashed upload is collected
    assert catalog_rows(data_dir) == [(1, "committed")]
    assert os.listdir(blobs / ".tmp") == []
    with CheckpointClient(svc.url, retries=0) as client:
        client.save("crash", 2, {"w": w + 1})
        assert_same_state({"w": w}, client.load("crash", 1))


def _fill(path: Path) -> None:
    """Take every free byte of the filesystem at ``path``."""
    with open(path / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError:
            pass


def test_a_full_catalog_disk_is_a_503_and_the_service_goes_on(
    make_service: Callable[..., Service], tmpfs: Callable[[int], Path], tmp_path: Path
) -> None:
    # SQLite's "database or disk is full" was a 500 internal_error (with the statement's
    # text); PostgreSQL's disk_full (SQLSTATE 53100) already was a 503
    disk = tmpfs(8 * MiB)
    env = {"CKPTSTORE_DATABASE_URL": f"sqlite:///{disk}/catalog.sqlite3"}
    svc = make_service(env, tmp_path / "data")
    w = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    with CheckpointClient(svc.url, retries=0) as client:
        client.save("full-db", 1, {"w": w})
        _fill(disk)
        try:
            for step in (2, 3):
                with pytest.raises(StorageUnavailable, match="disk is full") as info:
                    client.save("full-db", step, {f"t{i}": w + i for i in range(200)})
                assert info.value.status == 503
                assert "INSERT" not in str(info.value) and "SELECT" not in str(info.value)
            assert_same_state({"w": w}, client.load("full-db"))
        finally:
            (disk / "filler").unlink()
        client.save("full-db", 2, {"w": w + 1})  # room again
        assert_same_state({"w": w + 1}, client.load("full-db"))
