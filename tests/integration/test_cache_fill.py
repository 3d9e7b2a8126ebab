"""A load of a run's latest that misses the base cache (a replica that restarted) keeps a
copy in the cache as it streams (cache_policy.py, ``CachePolicy.fill``), written by a thread
of its own: the file holds exactly the checkpoint's raw bytes once the load has ended, and
a load cut short installs nothing and leaves no file behind. Real service, raw HTTP; what
is observable: the cache folder's files and the bytes served with the blobs gone."""

from __future__ import annotations

import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from ckptstore import CheckpointClient
from support.bodies import stored_data
from support.serviceproc import Service
from support.waiting import wait_until

RUN = "fill"


def slot(data_dir: Path) -> Path:
    (folder,) = (data_dir / "cache").glob("slot-*")
    return folder


def cached(data_dir: Path) -> list[Path]:
    """The checkpoint files installed (``<checkpoint id>.bin``)."""
    return sorted(slot(data_dir).glob("*.bin"))


def spares(data_dir: Path) -> list[Path]:
    """Files not installed: an earlier process's, adopted as spares, and fills under way."""
    return sorted(p for p in (slot(data_dir) / "tmp").iterdir() if p.is_file())


def saved_then_restarted(make_service: Callable[..., Service], data_dir: Path, mib: int) -> Service:
    """Three checkpoints of ``mib`` MiB (several chunks), then a fresh replica on the same
    data: its base cache holds nothing (the last process's file is a spare to overwrite)."""
    first = make_service(data_dir=data_dir)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(mib << 18, generator=g)
    with CheckpointClient(first.url) as client:
        for step in (1, 2, 3):
            w += 1e-3 * torch.randn(w.shape, generator=g)
            client.save(RUN, step, {"w": w, "b": torch.arange(step + 5.0)})
    first.stop()
    return make_service(data_dir=data_dir)


def test_a_cold_latest_load_leaves_its_exact_bytes_in_the_cache(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    data_dir = tmp_path / "svc"
    svc = saved_then_restarted(make_service, data_dir, 12)  # 3 chunks, several batches
    assert cached(data_dir) == [] and len(spares(data_dir)) == 1
    data = stored_data(svc, RUN, "latest")  # decoded from storage, copied as it streams
    (installed,) = wait_until(lambda: cached(data_dir), what="latest installed")
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
    assert cached(data_dir) == []
    data = stored_data(svc, RUN, "latest")
    (installed,) = wait_until(lambda: cached(data_dir), what="latest installed")
    assert installed.read_bytes() == data
