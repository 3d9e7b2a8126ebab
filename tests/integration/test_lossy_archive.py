"""Archival to the lossy tier by policy (issue 23, item 3), end to end on real services:
``lossy_after=K`` converts exactly the checkpoints older than the newest K (not the pinned,
not the run's first, which has no parent to rest on), in the background; the newest K and
the pinned ones stay bit-exact; converted ones load to the same bytes every time (also cold,
after a restart) and close to what was saved; stored bytes shrink and, once collected, the
blob store holds exactly what the catalog names. A SIGKILL in the middle of a conversion
loses nothing: every checkpoint loads to its old bytes or its converted ones, nothing is
left orphaned after a collection, and the conversion resumes and finishes."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptstore import CheckpointClient
from ckptstore_core.lossy import Lossy
from ckptstore_core.retention import RetentionPolicy
from ckptstore_service.maintenance.archive import PAUSE_ENV
from support.blobs import blob_files, catalog_blobs, check_store, collect_all, garbage_blobs
from support.serviceproc import Service, forget_cache, wait_idle
from support.states import assert_same_state, training_states
from support.waiting import wait_until

ENV = {
    "CKPTSTORE_REROOT_DEPTH": "0",
    "CKPTSTORE_REROOT_QUIET_S": "0",
    "CKPTSTORE_GARBAGE_GRACE_S": "0",
    "CKPTSTORE_KEYFRAME_INTERVAL": "4",  # keyframes at 0, 4, 8: converted ones among them
    "CKPTSTORE_CHUNK_BYTES": str(64 << 10),
}
# the tensors that pair_tensors pairs and that are large enough to be encoded lossy
LOSSY_WEIGHTS = ("0.weight", "3.weight")


@pytest.fixture(scope="module")
def states() -> list[dict[str, Any]]:
    return training_states(10)


def lossy_steps(client: CheckpointClient, run: str) -> list[int]:
    return [i.step for i in client.list(run) if i.lossy is not None]


def assert_converted(
    original: dict[str, Any], first: dict[str, Any], loaded: dict[str, Any], what: str
) -> None:
    """A lossy checkpoint: its large paired weights not all equal to the original's, but
    closer to them than the run's first checkpoint's are (each lossy link is a residual
    against its parent's reconstruction: errors do not pile up along the chain);
    everything the encoder does not touch bit-exact (biases, norms, bf16 copies, the
    frozen embedding, scheduler, RNG, counters)."""
    for name in LOSSY_WEIGHTS:
        w, got = original["model"][name], loaded["model"][name]
        err = (w - got).abs().mean()
        moved = (w - first["model"][name]).abs().mean()
        assert not torch.equal(w, got), f"{what}: {name} is bit-exact"
        assert err < moved, f"{what}: {name} off by {err} on average, {moved} from the first"
    exact = {k: v for k, v in original.items() if k not in ("model", "optimizer")}
    assert_same_state(exact, {k: loaded[k] for k in exact}, path=what)
    for name, w in original["model"].items():
        if name not in LOSSY_WEIGHTS:
            assert torch.equal(w, loaded["model"][name]), (what, name)
    assert original["optimizer"]["param_groups"] == loaded["optimizer"]["param_groups"]


def test_lossy_after_converts_exactly_the_old_checkpoints(
    make_service: Callable[..., Service], states: list[dict[str, Any]]
) -> None:
    svc = make_service(env=ENV)
    client = CheckpointClient(svc.url)
    for step in range(8):
        client.save("a", step, states[step])
    client.pin("a", 2)
    before = check_store(svc, client)

    for bad in ({"lossy": {"bits": 4}}, {"lossy_after": 1, "lossy": {"bits": 99}}):
        answer = httpx.put(f"{svc.url}/v1/runs/a/retention", json=bad, timeout=30)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "invalid_request"
    params = Lossy(weight_prune=0.8, moment_prune=0.8)
    stored = client.set_retention("a", lossy_after=3, lossy=params)
    assert stored == RetentionPolicy(lossy_after=3, lossy=params)
    wait_idle(svc.url)
    # older than the newest 3 (5, 6, 7): 0 to 4; not the pinned 2, not the first (no parent)
    assert lossy_steps(client, "a") == [1, 3, 4]
    infos = {i.step: i for i in client.list("a")}
    assert infos[1].lossy == params.to_json()
    # what was paired is listed with each converted checkpoint, as a lossy save lists it
    for step in (1, 3, 4):
        pairing = infos[step].pairing
        assert pairing is not None and pairing["with_moments"] >= len(LOSSY_WEIGHTS), step
    assert infos[2].pairing is None and infos[5].pairing is None
    assert [s for s, i in infos.items() if i.pinned] == [2]
    detail = client.run_info("a")
    assert detail.retention == detail.effective_retention == stored
    after = check_store(svc, client)
    print(f"\nlossy_after=3 on 8 checkpoints: {before} -> {after} stored bytes")
    assert after < before

    for step in (0, 2, 5, 6, 7):
        assert_same_state(states[step], client.load("a", step), path=f"a@{step}")
    loaded = {step: client.load("a", step) for step in (1, 3, 4)}
    for step, state in loaded.items():
        assert_converted(states[step], states[0], state, f"a@{step}")
        assert_same_state(state, client.load("a", step), path=f"a@{step} loaded twice")

    # cold: a restart with the base cache emptied gives the very same bytes
    svc.stop()
    forget_cache(svc.data_dir)
    svc.start()
    for step, state in loaded.items():
        assert_same_state(state, client.load("a", step), path=f"a@{step} after a restart")
    assert_same_state(states[7], client.load("a"), path="latest")

    # saves go on: each moves the oldest exact one to the lossy tier; mixed chains load
    client.save("a", 8, states[8])
    client.save("a", 9, states[9])
    wait_idle(svc.url)
    assert lossy_steps(client, "a") == [1, 3, 4, 5, 6]
    for step in (5, 6):
        assert_converted(states[step], states[0], client.load("a", step), f"a@{step}")
    for step in (0, 2, 7, 8, 9):
        assert_same_state(states[step], client.load("a", step), path=f"a@{step}")
    for step, state in loaded.items():
        assert_same_state(state, client.load("a", step), path=f"a@{step} after later ones")
    check_store(svc, client)


def named_not_committed(data: Path) -> set[str]:
    """Blobs on the garbage table that are written and that no row names: the new blobs
    of a conversion that has not committed."""
    db = data / "catalog.sqlite3"
    return (garbage_blobs(db) - catalog_blobs(db)) & set(blob_files(data))


@pytest.mark.slow
def test_sigkill_during_a_conversion_loses_nothing(
    make_service: Callable[..., Service], states: list[dict[str, Any]], tmp_path: Path
) -> None:
    """SIGKILL while a conversion waits to commit (its new blobs named and written), after
    an earlier one committed: after a restart each checkpoint loads to its old bytes or its
    converted ones and verifies; stopped again at the same point, a graceful stop does not
    hang and drops what it wrote; a collection leaves exactly what the catalog names; the
    conversion then resumes and finishes."""
    data = tmp_path / "data"
    svc = make_service(env={**ENV, PAUSE_ENV: "3"}, data_dir=data)
    client = CheckpointClient(svc.url)
    for step in range(6):
        client.save("k", step, states[step])
    client.set_retention("k", lossy_after=2)
    # step 1 first (oldest first): its commit after the pause, then step 2's pause
    wait_until(lambda: lossy_steps(client, "k") == [1], 60, "step 1 converted")
    converted = client.load("k", 1)
    wait_until(lambda: named_not_committed(data), 30, "step 2's new blobs written", 0.01)
    svc.kill()

    def check_either() -> None:
        assert lossy_steps(client, "k") == [1]
        assert_same_state(converted, client.load("k", 1), path="k@1 after the kill")
        for step in (0, 2, 3, 4, 5):
            assert_same_state(states[step], client.load("k", step), path=f"k@{step}")

    svc.env[PAUSE_ENV] = "3600"  # the resumed conversion waits at the same point
    svc.start()
    check_either()
    wait_until(lambda: named_not_committed(data), 60, "the conversion resumed", 0.05)
    check_either()
    svc.stop()  # the pause gives way to the stop: the conversion drops what it wrote
    assert svc.proc is not None and svc.proc.returncode != -signal.SIGKILL, "stop hung"
    named = catalog_blobs(data / "catalog.sqlite3")
    assert set(blob_files(data)) <= named | garbage_blobs(data / "catalog.sqlite3")
    collect_all(data)
    assert set(blob_files(data)) == named

    del svc.env[PAUSE_ENV]
    svc.start()
    wait_until(lambda: lossy_steps(client, "k") == [1, 2, 3], 60, "the archival finished")
    assert_same_state(converted, client.load("k", 1), path="k@1 at the end")
    for step in (2, 3):
        assert_converted(states[step], states[0], client.load("k", step), f"k@{step}")
    for step in (0, 4, 5):
        assert_same_state(states[step], client.load("k", step), path=f"k@{step}")
    check_store(svc, client)
