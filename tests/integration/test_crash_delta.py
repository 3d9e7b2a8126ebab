"""A service SIGKILLed in the middle of a delta save whose base it was overwriting in place.

``test_crash.py`` kills a run's second, raw-bytes upload. Here the run already has a delta
chain, the killed upload is a delta save with several tensors that rewrites its parent's base
cache file chunk by chunk, and the restarted service must still load every earlier checkpoint
bit-exactly, hide the partial one, and take a new delta save on top of the last committed one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from ckptstore import CheckpointClient
from ckptstore_service.catalog import Catalog
from support.bodies import client_body, partial_upload
from support.serviceproc import Service
from support.states import assert_same_state


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

    body, header = client_body(state_at(4))
    total = header.total_len
    # most of the body: the 4 MiB tensor and part of the next are through the codec and
    # have overwritten the parent's base cache file in place
    sock = partial_upload(svc.url, "chain", 4, body[: total * 3 // 4], total)
    catalog = Catalog(f"sqlite:///{data / 'catalog.sqlite3'}")
    deadline = time.monotonic() + 20
    while not catalog.uploads_in_progress() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert catalog.uploads_in_progress()
    time.sleep(0.5)  # let the ingest get well into the body
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
