"""The base cache across a restart. A load of a run's latest that misses the base cache keeps
a copy in the cache as it streams (cache_policy.py, ``CachePolicy.fill``), written by a
thread of its own: the file holds exactly the checkpoint's raw bytes once the load has ended,
and a load cut short installs nothing and leaves no file behind. The file an earlier process
installed is taken back on demand once every tensor in it matches its checksum (served with
the blobs gone), and a torn one is not. Real service, raw HTTP; what is observable: the
cache folder's files and the bytes served with the blobs gone."""

from __future__ import annotations

import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from ckptstore import CheckpointClient
from support.bodies import stored_data
from support.serviceproc import Service, cache_files
from support.waiting import wait_until

RUN = "fill"


def slot(data_dir: Path) -> Path:
    (folder,) = (data_dir / "cache").glob("slot-*")
    return folder


def spares(data_dir: Path) -> list[Path]:
    """Files not installed: an earlier process's, adopted as spares, and fills under way."""
    return sorted(p for p in (slot(data_dir) / "tmp").iterdir() if p.is_file())


def saved(make_service: Callable[..., Service], data_dir: Path, mib: int) -> bytes:
    """Three checkpoints of ``mib`` MiB (several chunks) saved, the service stopped; the
    latest's raw bytes. Its file is left installed (``<checkpoint id>.bin``)."""
    first = make_service(data_dir=data_dir)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(mib << 18, generator=g)
    with CheckpointClient(first.url) as client:
        for step in (1, 2, 3):
            w += 1e-3 * torch.randn(w.shape, generator=g)
            client.save(RUN, step, {"w": w, "b": torch.arange(step + 5.0)})
    data = stored_data(first, RUN, 3)
    first.stop()
    return data


def saved_then_restarted(make_service: Callable[..., Service], data_dir: Path, mib: int) -> Service:
    """:func:`saved`, its file made one no id names (an unfinished fill's), then a fresh
    replica on the same data: its base cache holds nothing, the file is a spare to overwrite."""
    saved(make_service, data_dir, mib)
    (installed,) = cache_files(data_dir)
    installed.rename(slot(data_dir) / "tmp" / "unnamed")
    return make_service(data_dir=data_dir)


def test_a_cold_latest_load_leaves_its_exact_bytes_in_the_cache(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    data_dir = tmp_path / "svc"
    svc = saved_then_restarted(make_service, data_dir, 12)  # 3 chunks, several batches
    assert cache_files(data_dir) == [] and len(spares(data_dir)) == 1
    data = stored_data(svc, RUN, "latest")  # decoded from storage, copied as it streams
    (installed,) = wait_until(lambda: cache_files(data_dir), what="latest installed")
    assert installed.read_bytes() == data
    assert spares(data_dir) == []  # the spare was overwritten, not a second file made
    shutil.rmtree(data_dir / "blobs")
    assert stored_data(svc, RUN, "latest") == data  # from the file alone
    assert stored_data(svc, RUN, 3) == data


def test_a_latest_load_cut_short_installs_nothing_and_the_next_one_fills(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    data_dir = tmp_path / "svc"
    svc = saved_then_restarted(make_service, data_dir, 48)  # more than sockets buffer
    with (
        httpx.Client(base_url=svc.url, timeout=60) as http,
        http.stream("GET", f"/v1/runs/{RUN}/checkpoints/latest") as response,
    ):
        assert response.status_code == 200
        head = next(response.iter_raw(1 << 20))
        (n,) = struct.unpack("<Q", head[:8])
        assert n > 0
    # the service finds the client gone at its next send: the fill is abandoned, its file
    # (the spare it was overwriting) deleted, nothing installed
    wait_until(lambda: spares(data_dir) == [], what="the abandoned fill's file deleted")
    assert cache_files(data_dir) == []
    data = stored_data(svc, RUN, "latest")
    (installed,) = wait_until(lambda: cache_files(data_dir), what="latest installed")
    assert installed.read_bytes() == data


def test_a_restarted_replica_serves_latest_from_the_file_the_last_one_left(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    data_dir = tmp_path / "svc"
    data = saved(make_service, data_dir, 12)
    svc = make_service(data_dir=data_dir)
    (data_dir / "blobs").rename(tmp_path / "blobs-away")  # only the file can serve it now
    assert stored_data(svc, RUN, "latest") == data
    (installed,) = cache_files(data_dir)
    assert installed.read_bytes() == data and spares(data_dir) == []
    (tmp_path / "blobs-away").rename(data_dir / "blobs")
    with CheckpointClient(svc.url) as client:  # the next save diffs against the file
        state = client.load(RUN, 3)
        state["w"] += 1.0
        assert client.save(RUN, 4, state).parent_step == 3
    svc.stop()
    again = make_service(data_dir=data_dir)  # no file of step 4 trusted without its check
    with CheckpointClient(again.url) as client:
        back = client.load(RUN, 4)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])


@pytest.mark.parametrize("damage", ["a-flipped-byte", "cut-short"])
def test_a_file_left_torn_is_not_trusted(
    make_service: Callable[..., Service], tmp_path: Path, damage: str
) -> None:
    data_dir = tmp_path / "svc"
    data = saved(make_service, data_dir, 12)
    (installed,) = cache_files(data_dir)
    with open(installed, "r+b") as f:
        if damage == "cut-short":
            f.truncate(len(data) - 4)
        else:
            f.seek(len(data) // 2)
            byte = f.read(1)
            f.seek(len(data) // 2)
            f.write(bytes([byte[0] ^ 1]))
    svc = make_service(data_dir=data_dir)
    assert stored_data(svc, RUN, "latest") == data  # decoded from storage
    assert "does not match its checksums" in svc.log.read_text()
    (filled,) = wait_until(lambda: cache_files(data_dir), what="latest installed")
    assert filled.read_bytes() == data
