"""A service SIGKILLed in the middle of a delta save whose base it was overwriting in place.

``test_crash.py`` kills a run's second, raw-bytes upload. Here the run already has a delta
chain, the killed upload is a delta save with several tensors that rewrites its parent's base
cache file chunk by chunk, and the restarted service must still load every earlier checkpoint
bit-exactly, hide the partial one, and take a new delta save on top of the last committed one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from ckptstore import CheckpointClient
from ckptstore.state import tensor_bytes
from ckptstore_service.catalog import Catalog
from support.bodies import client_body, partial_upload
from support.serviceproc import Service
from support.states import assert_same_state
from support.waiting import wait_until


def state_at(step: int) -> dict[str, object]:
    """A model + optimizer state that drifts a little from step to step (deltas pay)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 1024, generator=g)  # 4 MiB: one full chunk
    emb = torch.randn(3000, 256, generator=g)
    drift = torch.randn(1024, 1024, generator=g) * 1e-4
    return {
        "model": {"w": w + step * drift, "emb": emb * (1 - 1e-3 * step), "b": torch.ones(7)},
        "optim": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": []},
        "step": step,
    }


def test_sigkill_mid_delta_save_keeps_the_chain_loadable(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    svc = make_service(None, data)
    with CheckpointClient(svc.url, retries=0) as client:
        for step in (1, 2, 3):
            client.save("chain", step, state_at(step))
        assert [c.chain_depth for c in client.list("chain")] == [0, 1, 2]

    new = state_at(4)
    body, header = client_body(new)
    total = header.total_len
    # most of the body: the 4 MiB tensor and part of the next are through the codec and
    # have overwritten the parent's base cache file in place
    sock = partial_upload(svc.url, "chain", 4, body[: total * 3 // 4], total)
    catalog = Catalog(f"sqlite:///{data / 'catalog.sqlite3'}")
    wait_until(catalog.uploads_in_progress, what="the upload began")
    assert catalog.uploads_in_progress()
    # the save took its parent's cache file (it left slot-0 for slot-0/tmp) and rewrites it
    # in place: wait until the 4 MiB tensor's new bytes are in it
    (w,) = [t for t in header.tensors if t.name == "model/w"]
    new_w = bytes(tensor_bytes(new["model"]["w"]))
    assert w.end - w.begin == len(new_w) == 4 << 20
    taken = data / "cache" / "slot-0" / "tmp"

    def base_overwritten() -> bool:
        for path in taken.iterdir():
            try:
                with open(path, "rb") as f:
                    f.seek(w.begin)
                    if f.read(len(new_w)) == new_w:
                        return True
            except FileNotFoundError:  # another file of the folder, gone meanwhile
                pass
        return False

    wait_until(base_overwritten, what="the ingest rewrote the 4 MiB tensor of its base")
    svc.kill()
    sock.close()

    svc = make_service(None, data)
    assert catalog.uploads_in_progress() == []
    catalog.close()
    listed = httpx.get(f"{svc.url}/v1/runs/chain/checkpoints").json()["checkpoints"]
    assert [c["step"] for c in listed] == [1, 2, 3]
    with CheckpointClient(svc.url, retries=0) as client:
        assert_same_state(state_at(3), client.load("chain"))  # latest: rebuilt, not the torn file
        for step in (3, 2, 1):
            assert_same_state(state_at(step), client.load("chain", step))
        info = client.save("chain", 4, state_at(4))
        assert info.parent_step == 3 and not info.keyframe
        assert_same_state(state_at(4), client.load("chain"))
        assert_same_state(state_at(4), client.load("chain", 4))
        assert_same_state(state_at(3), client.load("chain", 3))
