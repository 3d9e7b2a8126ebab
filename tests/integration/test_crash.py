"""A service killed in the middle of an upload (embedded defaults: SQLite + local folder)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from ckptstore import CheckpointClient
from ckptstore_core.wire import FORMAT, encode_header
from ckptstore_service.catalog import Catalog
from support.bodies import partial_upload
from support.serviceproc import Service
from support.waiting import wait_until


def test_sigkill_mid_upload_leaves_nothing_and_the_retry_works(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    svc = make_service(None, data)
    with CheckpointClient(svc.url) as client:
        client.save("crash", 1, {"w": torch.zeros(1000)})
    n = 16 << 20
    prefix, header = encode_header([("w", "U8", (n,))], {"format": FORMAT})
    sock = partial_upload(svc.url, "crash", 2, prefix + os.urandom(n // 2), header.total_len)
    catalog = Catalog(f"sqlite:///{data / 'catalog.sqlite3'}")
    wait_until(catalog.uploads_in_progress, what="the upload began")
    temp = data / "blobs" / ".tmp"
    wait_until(lambda: any(temp.iterdir()), what="the upload's blob was begun")
    assert catalog.uploads_in_progress() and any(temp.iterdir())
    svc.kill()
    sock.close()

    svc = make_service(None, data)  # restart: the crashed upload is collected
    assert catalog.uploads_in_progress() == []
    assert list(temp.iterdir()) == []
    listed = httpx.get(f"{svc.url}/v1/runs/crash/checkpoints").json()["checkpoints"]
    assert [c["step"] for c in listed] == [1]
    state = {"w": torch.arange(n, dtype=torch.uint8)}
    with CheckpointClient(svc.url) as client:
        assert client.save("crash", 2, state).parent_step == 1
        assert torch.equal(client.load("crash")["w"], state["w"])
    blobs = sorted(p.name for p in (data / "blobs" / "runs" / "crash").iterdir())
    assert len(blobs) == 2  # the crashed upload's blob never appeared
    catalog.close()


def test_services_sharing_a_data_dir_keep_to_their_own_cache_files(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    data = tmp_path / "shared"  # e.g. replicas scaled out on one volume
    first = make_service(None, data)
    with CheckpointClient(first.url) as client:
        client.save("own", 1, {"w": torch.arange(1000.0)})
    slot = data / "cache" / "slot-0"
    before = {p: p.stat().st_ino for p in slot.rglob("*.bin")}
    assert before  # the first service's base cache
    second = make_service(None, data)
    with CheckpointClient(second.url) as client:
        client.save("theirs", 1, {"w": torch.zeros(1000)})
        client.save("theirs", 2, {"w": torch.ones(1000)})
    assert {p: p.stat().st_ino for p in slot.rglob("*.bin")} == before
    assert list((data / "cache" / "slot-1").rglob("*.bin"))
    with CheckpointClient(first.url) as client:
        client.save("own", 2, {"w": torch.arange(1000.0) + 1})
        assert torch.equal(client.load("own")["w"], torch.arange(1000.0) + 1)
