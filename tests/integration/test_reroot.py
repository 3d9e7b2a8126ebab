"""Re-rooting rewrites committed checkpoints: every one must still load bit-exactly, during
and after, and nothing may be left behind or lost, on SQLite and on PostgreSQL."""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptstore import CheckpointClient
from ckptstore_core.errors import StorageUnavailable
from ckptstore_service.catalog import Catalog
from ckptstore_service.maintenance import RerootPolicy, collect_garbage, reroot
from ckptstore_service.runtime import Runtime
from ckptstore_service.settings import Settings
from support.blobs import blob_files
from support.s3server import s3_store
from support.serviceproc import Service, forget_cache, wait_idle
from support.states import assert_same_state, training_states

REROOT = 4
STEPS = 12
ENV = {
    "CKPTSTORE_REROOT_DEPTH": str(REROOT),
    "CKPTSTORE_REROOT_QUIET_S": "0",
    "CKPTSTORE_KEYFRAME_INTERVAL": "100",
    "CKPTSTORE_MAX_CHAIN_DEPTH": "100",
    # small chunks: each tensor several chunks, so chains branch and refs cross checkpoints
    "CKPTSTORE_CHUNK_BYTES": str(64 << 10),
}


@pytest.fixture(scope="module")
def states() -> list[dict[str, Any]]:
    return training_states(STEPS)


def check_all(client: CheckpointClient, states: list[dict[str, Any]], run: str) -> None:
    for step, state in enumerate(states):
        assert_same_state(state, client.load(run, step), path=f"step {step}")


def test_reroot_keeps_every_checkpoint_and_the_newest_shallow(
    make_service: Callable[..., Service], database_url: str, states: list[dict[str, Any]]
) -> None:
    svc = make_service(
        env={**ENV, "CKPTSTORE_DATABASE_URL": database_url, "CKPTSTORE_GARBAGE_GRACE_S": "0"}
    )
    client = CheckpointClient(svc.url)
    linear = make_service(env={**ENV, "CKPTSTORE_REROOT_DEPTH": "0"})
    plain = CheckpointClient(linear.url)
    for step, state in enumerate(states):
        client.save("r", step, state)
        plain.save("r", step, state)
        wait_idle(svc.url)
        infos = client.list("r")
        # the newest checkpoint never stays REROOT deep: the save that made it so re-rooted
        assert infos[-1].chain_depth < REROOT, [i.chain_depth for i in infos]
    infos = client.list("r")
    before = plain.list("r")
    depths = [i.chain_depth for i in infos]
    # the same run, not re-rooted (the bf16 copies add one link: they are casts)
    assert [i.chain_depth for i in before] == list(range(1, STEPS + 1))
    # the root moved towards the newest checkpoint: the oldest ones are the deepest now
    assert depths[0] == max(depths) > depths[-1]
    assert sum(d == min(depths) for d in depths) == 1
    # the root is the one keyframe now (its bf16 copies are casts of its whole masters)
    assert [i.keyframe for i in infos] == [d == min(depths) for d in depths]
    # a delta is still one checkpoint long: hardly more bytes than the linear chain
    stored = sum(i.stored_bytes for i in infos)
    assert stored <= 1.05 * sum(i.stored_bytes for i in before)
    check_all(client, states, "r")
    # nothing left behind: the blobs are exactly the checkpoints' (grace 0), sizes reported
    if database_url.startswith("sqlite"):
        with sqlite3.connect(database_url.removeprefix("sqlite:///")) as db:
            keys = {k for (k,) in db.execute("SELECT blob_key FROM checkpoints")}
            assert db.execute("SELECT count(*) FROM garbage").fetchone() == (0,)
        files = blob_files(svc.data_dir)
        assert set(files) == keys
        assert sum(files.values()) == stored
    # and after a restart (no base cache: every load decodes from storage)
    svc.stop()
    forget_cache(svc.data_dir)
    svc.start()
    check_all(client, states, "r")
    # the run goes on: later saves delta against the re-rooted chain
    more = training_states(STEPS + 3)[STEPS:]
    for i, state in enumerate(more):
        client.save("r", STEPS + i, state)
    wait_idle(svc.url)
    check_all(client, states + more, "r")


def test_loads_during_reroots_are_exact(
    make_service: Callable[..., Service], database_url: str, states: list[dict[str, Any]]
) -> None:
    """Loads of every step race the saves and the re-roots they set off: each one must be
    the exact state, whichever shape of the chain it read (a load in progress across a
    commit is forced in test_a_load_in_progress_survives_the_reroot_of_its_chain)."""
    svc = make_service(env={**ENV, "CKPTSTORE_DATABASE_URL": database_url})
    client = CheckpointClient(svc.url)
    saved = threading.Semaphore(0)
    done = threading.Event()
    errors: list[BaseException] = []
    loads = [0]

    def loader(seed: int) -> None:
        rng = random.Random(seed)
        reader = CheckpointClient(svc.url)
        top = -1
        try:
            while not done.is_set() or loads[0] < 40:
                while saved.acquire(blocking=False):
                    top += 1
                if top < 0:  # nothing saved yet: wait for the first save
                    if saved.acquire(timeout=1):
                        top += 1
                    continue
                step = rng.randint(0, top)
                assert_same_state(states[step], reader.load("r", step), path=f"step {step}")
                loads[0] += 1
        except BaseException as exc:
            errors.append(exc)
            done.set()

    threads = [threading.Thread(target=loader, args=(i,)) for i in range(1)]
    for t in threads:
        t.start()
    for step, state in enumerate(states):
        if errors:
            break
        client.save("r", step, state)
        saved.release()
    wait_idle(svc.url)
    done.set()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    assert loads[0] >= 40
    assert client.list("r")[-1].chain_depth < REROOT
    check_all(client, states, "r")


class FailingStore:
    """Wraps a blob store: its ``fail_on``-th ``put_stream`` fails after the first piece (a
    full disk, a lost S3 connection in the middle of a re-root)."""

    def __init__(self, store: Any, fail_on: int) -> None:
        self._store = store
        self._calls = 0
        self._fail_on = fail_on

    def put_stream(self, key: str, chunks: Any) -> int:
        self._calls += 1
        if self._calls != self._fail_on:
            return int(self._store.put_stream(key, chunks))

        def cut() -> Any:
            for i, piece in enumerate(chunks):
                if i == 1:
                    raise StorageUnavailable("injected: the store went away mid-blob")
                yield piece

        return int(self._store.put_stream(key, cut()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.mark.parametrize("fail_at", ["blob", "commit", "commit and clean-up"])
def test_a_failed_reroot_changes_nothing_and_leaves_nothing(
    make_service: Callable[..., Service],
    tmp_path: Path,
    states: list[dict[str, Any]],
    fail_at: str,
) -> None:
    data = tmp_path / "data"
    svc = make_service(env={**ENV, "CKPTSTORE_REROOT_DEPTH": "0"}, data_dir=data)
    client = CheckpointClient(svc.url)
    for step, state in enumerate(states[:7]):
        client.save("r", step, state)
    svc.stop()

    settings = Settings(
        data_dir=data,
        reroot_depth=REROOT,
        keyframe_interval=100,
        max_chain_depth=100,
        chunk_bytes=64 << 10,
        garbage_grace_s=0,
    )
    rt = Runtime.open(settings)
    try:
        before = rt.catalog.list_checkpoints("r")
        keys = {i.blob_key for i in before}
        if fail_at == "blob":  # the first new blob is written, the second one fails
            rt.store = FailingStore(rt.store, fail_on=2)
        else:

            def no_commit(*args: Any, **kwargs: Any) -> None:
                raise StorageUnavailable("injected: the database went away at the commit")

            rt.catalog.commit_reroot = no_commit  # type: ignore[method-assign]
        if fail_at == "commit and clean-up":  # as if the process died there
            real_delete = rt.store.delete

            def no_delete(key: str) -> None:
                raise StorageUnavailable("injected: cannot delete")

            rt.store.delete = no_delete  # type: ignore[method-assign]
        with pytest.raises(StorageUnavailable, match="injected"):
            policy = RerootPolicy.of(rt.settings, rt.budget)
            reroot(rt.catalog, rt.store, "r", policy, scratch=rt.cache.scratch)
        assert rt.catalog.list_checkpoints("r") == before  # the catalog is as it was
        named = {k for _, _, k in rt.catalog.garbage("r", datetime.max.replace(tzinfo=UTC))}
        if fail_at != "commit and clean-up":  # the re-root deleted what it wrote
            assert not named
            assert set(blob_files(data)) == keys
        else:  # what it wrote was named before it was written, and is collected later
            rt.store.delete = real_delete  # type: ignore[method-assign]
            extra = set(blob_files(data)) - keys
            assert extra and extra == named
            # not due yet: it might be a live re-root
            assert collect_garbage(rt.catalog, rt.store, "r") == 0
            later = datetime.now(UTC) + timedelta(seconds=settings.incomplete_upload_ttl_s + 1)
            # nor while a re-root of the run runs
            with rt.catalog.reroot_lock("r", blocking=False) as held:
                assert held
                assert collect_garbage(rt.catalog, rt.store, "r", now=later) == 0
            assert collect_garbage(rt.catalog, rt.store, "r", now=later) == len(named)
            assert set(blob_files(data)) == keys
            assert not rt.catalog.garbage("r", later)
    finally:
        rt.close()
    svc.start()
    check_all(client, states[:7], "r")


def test_bf16_copies_and_frozen_tensors_survive(
    make_service: Callable[..., Service],
) -> None:
    """Copies predicted from their fp32 master, and refs across the whole run."""
    torch.manual_seed(1)
    master = torch.randn(300, 257)
    frozen = torch.randn(1000)
    states = []
    for _ in range(10):
        master += 1e-3 * torch.randn_like(master)
        states.append(
            {
                "master": {"w": master.clone()},
                "model": {"w": master.bfloat16()},
                "frozen": frozen.clone(),
            }
        )
    svc = make_service(env={**ENV, "CKPTSTORE_GARBAGE_GRACE_S": "0"})
    client = CheckpointClient(svc.url)
    for step, state in enumerate(states):
        client.save("b", step, state)
    wait_idle(svc.url)
    assert client.list("b")[-1].chain_depth < REROOT
    check_all(client, states, "b")


def test_a_load_in_progress_survives_the_reroot_of_its_chain(
    make_service: Callable[..., Service],
) -> None:
    """A GET that read the catalog before a re-root committed goes on with the old chain
    shape and the old blobs (kept for the grace time), and sends the exact bytes."""
    torch.manual_seed(2)
    w = torch.randn(20, 1 << 20)  # 80 MB: far more than the restore decodes ahead
    states = []
    for _ in range(REROOT + 1):
        w += 1e-3 * torch.randn_like(w)
        states.append({"w": w.clone()})
    svc = make_service(env={**ENV, "CKPTSTORE_CHUNK_BYTES": str(4 << 20)})
    client = CheckpointClient(svc.url)
    for step, state in enumerate(states[:REROOT]):
        client.save("g", step, state)
    wait_idle(svc.url)
    with httpx.stream("GET", f"{svc.url}/v1/runs/g/checkpoints/1", timeout=60) as response:
        assert response.status_code == 200
        body = response.iter_raw(1 << 16)
        first = next(body)  # the restore has its chunk rows, and decodes on as we read
        client.save("g", REROOT, states[REROOT])  # sets off the re-root of steps 0-2
        wait_idle(svc.url)
        # step 2 is the root now, steps 1 and 0 were rewritten as deltas of their successors
        assert [i.chain_depth for i in client.list("g")] == [2, 1, 0, 1, 2]
        data = first + b"".join(body)
    again = httpx.get(f"{svc.url}/v1/runs/g/checkpoints/1", timeout=60).content
    assert data == again  # the same bytes, the old shape and the new one
    assert_same_state(states[1], client.load("g", 1))


@pytest.mark.postgres
@pytest.mark.s3
def test_two_replicas_on_postgres_and_s3_reroot_one_run(
    make_service: Callable[..., Service],
    backends: dict[str, str],
    states: list[dict[str, Any]],
) -> None:
    """Saves alternate between two replicas, so both maintenance threads go for the same
    run: one re-root at a time (the re-root lock lives in PostgreSQL), blobs rewritten on
    S3 from S3, and afterwards the bucket holds exactly the checkpoints' blobs."""
    env = {
        **backends,
        **ENV,
        "CKPTSTORE_KEYFRAME_INTERVAL": "100",
        "CKPTSTORE_GARBAGE_GRACE_S": "0",
    }
    replicas = [make_service(env), make_service(env)]
    clients = [CheckpointClient(r.url) for r in replicas]
    for step, state in enumerate(states):
        clients[step % 2].save("both", step, state)
    for svc in replicas:
        wait_idle(svc.url)
    infos = clients[0].list("both")
    assert infos[-1].chain_depth < REROOT
    for client in clients:
        check_all(client, states, "both")
    catalog = Catalog(backends["CKPTSTORE_DATABASE_URL"])
    try:
        keys = {i.blob_key for i in catalog.list_checkpoints("both")}
    finally:
        catalog.close()
    store = s3_store(backends)
    assert set(store.iter_keys("runs/both/")) == keys
    assert store.list_open_uploads() == []


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.05, 0.4, 0.6, 0.75])
def test_a_crash_at_any_point_of_a_reroot_loses_nothing(
    make_service: Callable[..., Service], tmp_path: Path, delay: float
) -> None:
    """SIGKILL the service ``delay`` seconds after the save that sets off a re-root (which
    took 0.8 s here: the delays land in its encoding, its blob writing and around its
    commit, or just after it on a faster machine): after a restart every checkpoint loads
    exactly, and every blob on disk is either a checkpoint's or named on the garbage table."""
    torch.manual_seed(3)
    w = torch.randn(10, 1 << 20)
    states = []
    for _ in range(REROOT + 1):
        w += 1e-3 * torch.randn_like(w)
        states.append({"w": w.clone(), "m": (w * 0.5).clone()})
    data = tmp_path / "data"
    env = {**ENV, "CKPTSTORE_CHUNK_BYTES": str(1 << 20), "CKPTSTORE_GARBAGE_GRACE_S": "0"}
    svc = make_service(env=env, data_dir=data)
    client = CheckpointClient(svc.url)
    for step, state in enumerate(states):
        client.save("k", step, state)  # the last one sets off the re-root
    # not a wait for something: the re-root runs on in the background for ``delay`` seconds,
    # so that the SIGKILL lands at one point of it or another
    time.sleep(delay)
    svc.kill()
    svc.start()
    check_all(client, states, "k")
    with sqlite3.connect(data / "catalog.sqlite3") as db:
        keys = {k for (k,) in db.execute("SELECT blob_key FROM checkpoints")}
        named = {k for (k,) in db.execute("SELECT blob_key FROM garbage")}
    assert set(blob_files(data)) <= keys | named
    assert not keys & named
    # and the run goes on: the next save re-roots it for good
    w += 1e-3 * torch.randn_like(w)
    states.append({"w": w.clone(), "m": (w * 0.5).clone()})
    client.save("k", len(states) - 1, states[-1])
    wait_idle(svc.url)
    assert client.list("k")[-1].chain_depth < REROOT
    check_all(client, states, "k")


def test_a_long_chain_stays_within_max_chain_depth(
    make_service: Callable[..., Service], states: list[dict[str, Any]]
) -> None:
    """Keyframes far apart, a small MAX_CHAIN_DEPTH: the root keeps moving while that keeps
    the oldest checkpoints within MAX_CHAIN_DEPTH (+1 for the bf16 copies), then the chains
    are cut (chunks stored whole) and re-rooting starts over; nothing gets deeper."""
    limit = 6
    more = training_states(2 * STEPS)
    svc = make_service(env={**ENV, "CKPTSTORE_MAX_CHAIN_DEPTH": str(limit)})
    client = CheckpointClient(svc.url)
    seen = []
    for step, state in enumerate(more):
        client.save("long", step, state)
        wait_idle(svc.url)
        depths = [i.chain_depth for i in client.list("long")]
        assert max(depths) <= limit + 1, depths
        seen.append(depths)
    assert seen[-1][0] > 0  # the first checkpoint is not the root any more
    assert min(max(d) for d in seen[REROOT:]) < limit + 1  # re-roots kept depths down
    check_all(client, more, "long")
