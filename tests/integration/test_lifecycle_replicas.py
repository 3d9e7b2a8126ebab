"""Two replicas on PostgreSQL + S3 (moto) at once (issue 20, item 6): saves, deletes,
retention passes and loads from threads through both, against what must remain.

* Every load is the exact state of the step it names (``latest``: of the step it says it
  is), or ``CheckpointNotFound`` for a step that a delete or the retention policy may have
  taken; never other bytes, never another error. The grace time is at its default, so a
  load that read the catalog before a delete's commit reads blobs that are still there.
* A checkpoint deleted through both replicas at the same moment is deleted once: one
  answer 204, the other 404 ``checkpoint_not_found``.
* Both replicas apply the retention policies (after the saves each takes, and at once when
  one is set through both at the same moment): no pass fails, nothing is deleted twice,
  and exactly the steps the policies keep remain, each exact through either replica.
* Afterwards a collection as with grace 0 leaves the bucket holding exactly the blobs the
  catalog names.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

import httpx
import pytest
import torch

from ckptstore import CheckpointClient
from ckptstore_core.errors import CheckpointNotFound
from ckptstore_core.retention import Candidate, RetentionPolicy, kept_steps
from ckptstore_service.catalog import Catalog
from ckptstore_service.maintenance import collect_garbage
from support.blobs import named_blobs
from support.s3server import s3_store
from support.serviceproc import Service, maintenance_runs, wait_idle
from support.states import assert_same_state

pytestmark = [pytest.mark.postgres, pytest.mark.s3, pytest.mark.slow]

ENV = {
    "CKPTSTORE_REROOT_DEPTH": "3",  # re-roots too, on both replicas
    "CKPTSTORE_REROOT_QUIET_S": "0",
    "CKPTSTORE_KEYFRAME_INTERVAL": "4",
    "CKPTSTORE_CHUNK_BYTES": str(64 << 10),
    "CKPTSTORE_SWEEP_INTERVAL_S": "1",
}
STEPS = 16
RETAINED = RetentionPolicy(keep_last=2, keep_every=4)  # "ret", set before its saves
AT_ONCE = RetentionPolicy(keep_last=2, keep_every=3)  # "del", set through both at the end


@lru_cache(maxsize=64)
def state(run: str, step: int) -> dict[str, Any]:
    """A tiny state (about 200 KB) of ``run`` at ``step``, close to its previous step's:
    a small drift everywhere, a moving band of new values, a frozen table (refs)."""
    g = torch.Generator().manual_seed(len(run))
    w = torch.randn(1 << 15, generator=g) + 1e-4 * step * torch.randn(1 << 15, generator=g)
    band = (step * 1009) % ((1 << 15) - 512)
    w[band : band + 512] = torch.randn(512, generator=torch.Generator().manual_seed(step))
    return {"w": w, "frozen": torch.randn(1 << 14, generator=g), "step": step}


class Shared:
    """What the threads know: the steps committed so far, and those a delete may take."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.saved: dict[str, list[int]] = {"ret": [], "del": []}
        self.doomed: set[int] = set()  # steps of "del" whose delete has begun
        self.deleted: set[int] = set()  # ... and whose delete answered 204
        self.errors: list[BaseException] = []
        self.loads = {"exact": 0, "gone": 0}
        self.done = threading.Event()

    def may_be_gone(self, run: str, step: int) -> bool:
        """Whether ``CheckpointNotFound`` is a right answer for ``run@step``."""
        if run == "del":
            return step in self.doomed
        return step % RETAINED.keep_every != 0 and step < STEPS - RETAINED.keep_last

    def guarded(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                self.errors.append(exc)
                self.done.set()

        return run


def check_run(clients: list[CheckpointClient], run: str, steps: list[int]) -> None:
    """The run holds exactly ``steps``, each exact through every replica."""
    for client in clients:
        assert [i.step for i in client.list(run)] == steps, run
        for step in steps:
            assert_same_state(state(run, step), client.load(run, step), path=f"{run}@{step}")


def test_two_replicas_save_delete_retain_and_load_at_once(
    make_service: Callable[..., Service], backends: dict[str, str]
) -> None:
    env = {**backends, **ENV}
    a, b = make_service(env=env), make_service(env=env)
    clients = [CheckpointClient(a.url), CheckpointClient(b.url)]
    urls = [a.url, b.url]
    clients[0].set_retention("ret", RETAINED.keep_last, RETAINED.keep_every)
    shared = Shared()

    def saver(run: str, first: int) -> Callable[[], None]:
        """Saves ``run``'s steps in order, through the replicas in turn."""

        def save() -> None:
            for step in range(STEPS):
                clients[(step + first) % 2].save(run, step, state(run, step))
                with shared.lock:
                    shared.saved[run].append(step)

        return save

    def deleter() -> None:
        """Deletes a committed step of "del" through both replicas at the same moment."""
        rng = random.Random(1)
        barrier = threading.Barrier(2)
        answers: list[httpx.Response] = []

        def delete(url: str, step: int) -> None:
            barrier.wait(30)
            answers.append(httpx.delete(f"{url}/v1/runs/del/checkpoints/{step}", timeout=60))

        for _ in range(5):
            with shared.lock:
                left = [s for s in shared.saved["del"] if s not in shared.doomed]
            while len(left) < 2 and not shared.done.is_set():
                with shared.lock:
                    left = [s for s in shared.saved["del"] if s not in shared.doomed]
                shared.done.wait(0.05)  # a save lands every few tens of ms
            if shared.done.is_set():
                return
            step = rng.choice(left)
            shared.doomed.add(step)
            answers.clear()
            threads = [threading.Thread(target=delete, args=(u, step)) for u in urls]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            codes = sorted(r.status_code for r in answers)
            assert codes == [204, 404], (step, [r.text for r in answers])
            gone = next(r for r in answers if r.status_code == 404)
            assert gone.json()["error"]["code"] == CheckpointNotFound.code
            shared.deleted.add(step)

    def loader(which: int) -> Callable[[], None]:
        """Loads committed steps (and ``latest``) of both runs through one replica."""

        def load() -> None:
            rng = random.Random(which)
            client = CheckpointClient(urls[which])
            while not shared.done.is_set():
                run = rng.choice(["ret", "del"])
                with shared.lock:
                    saved = list(shared.saved[run])
                if not saved:
                    shared.done.wait(0.02)
                    continue
                if rng.random() < 0.2:
                    try:
                        got = client.load(run)
                    except CheckpointNotFound:  # "del": every step so far being deleted
                        assert run == "del" and set(saved) <= shared.doomed
                        continue
                    assert_same_state(state(run, got["step"]), got, path=f"{run}@latest")
                    continue
                step = rng.choice(saved)
                try:
                    got = client.load(run, step)
                except CheckpointNotFound:
                    assert shared.may_be_gone(run, step), f"{run}@{step} lost"
                    shared.loads["gone"] += 1
                    continue
                assert_same_state(state(run, step), got, path=f"{run}@{step}")
                shared.loads["exact"] += 1

        return load

    savers = [
        threading.Thread(target=shared.guarded(saver("ret", 0))),
        threading.Thread(target=shared.guarded(saver("del", 1))),
        threading.Thread(target=shared.guarded(deleter)),
    ]
    loaders = [threading.Thread(target=shared.guarded(loader(i))) for i in (0, 1)]
    for t in savers + loaders:
        t.start()
    for t in savers:
        t.join(120)
    shared.done.set()
    for t in loaders:
        t.join(60)
    assert not shared.errors, shared.errors[0]
    assert len(shared.deleted) == 5 and shared.loads["exact"] >= 20, shared.loads

    for url in urls:
        wait_idle(url)
    kept = sorted(s for s in range(STEPS) if s % 4 == 0 or s >= STEPS - 2)
    check_run(clients, "ret", kept)
    remaining = sorted(set(range(STEPS)) - shared.deleted)
    check_run(clients, "del", remaining)

    # the same policy set through both replicas at the same moment: each applies it
    barrier = threading.Barrier(2)

    def put(client: CheckpointClient) -> None:
        barrier.wait(30)
        assert client.set_retention("del", AT_ONCE.keep_last, AT_ONCE.keep_every) == AT_ONCE

    puts = [threading.Thread(target=shared.guarded(lambda c=c: put(c))) for c in clients]
    for t in puts:
        t.start()
    for t in puts:
        t.join(60)
    assert not shared.errors, shared.errors[0]
    for url in urls:
        wait_idle(url)
    left = kept_steps(AT_ONCE, [Candidate(s, False, {}) for s in remaining])
    assert left < set(remaining)
    check_run(clients, "del", sorted(left))
    for url in urls:
        assert maintenance_runs(url, "ok", task="retention") > 0
        assert maintenance_runs(url, "error") == 0  # no pass failed: nothing deleted twice

    # afterwards, a collection as with grace 0: the bucket holds what the catalog names
    a.stop()
    b.stop()
    catalog = Catalog(backends["CKPTSTORE_DATABASE_URL"])
    store = s3_store(backends)
    try:
        collect_garbage(catalog, store, None, now=datetime.now(UTC) + timedelta(days=1))
        assert not catalog.garbage(None, datetime.now(UTC) + timedelta(days=1))
        assert set(store.iter_keys()) == named_blobs(backends["CKPTSTORE_DATABASE_URL"])
        assert store.list_open_uploads() == []
    finally:
        store.close()
        catalog.close()
