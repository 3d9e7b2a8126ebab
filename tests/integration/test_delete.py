"""Deleting checkpoints and runs (issue 20, item 1): whatever goes, every remaining checkpoint
loads bit-exactly, during and after, and after a collection with grace 0 the blob store
holds exactly the blobs the catalog names; on SQLite, and on PostgreSQL for the races."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptstore import CheckpointClient
from ckptstore.cli import main
from ckptstore_core.errors import (
    CheckpointNotFound,
    InvalidRequest,
    RunNotFound,
    StorageUnavailable,
)
from ckptstore_service.api.parts import checkpoint_info
from ckptstore_service.catalog import Catalog, CheckpointRecord
from ckptstore_service.maintenance import RerootPolicy
from ckptstore_service.maintenance.delete import delete_checkpoint
from ckptstore_service.names import parse_blob_key
from ckptstore_service.runtime import Runtime
from ckptstore_service.settings import Settings
from support.blobs import (
    blob_files,
    catalog_blobs,
    check_store,
    collect_all,
    garbage_blobs,
    named_blobs,
)
from support.parts import commit, save_in_parts, shards, tensors_of
from support.s3server import s3_store
from support.serviceproc import Service, forget_cache, wait_idle
from support.states import assert_same_state, training_states
from support.waiting import wait_until

ENV = {
    "CKPTSTORE_REROOT_DEPTH": "0",
    "CKPTSTORE_REROOT_QUIET_S": "0",
    "CKPTSTORE_KEYFRAME_INTERVAL": "4",  # keyframes at steps 0, 4, 8
    "CKPTSTORE_GARBAGE_GRACE_S": "0",
    # small chunks: each tensor several chunks, refs (the frozen embedding) across the run
    "CKPTSTORE_CHUNK_BYTES": str(64 << 10),
    "CKPTSTORE_SWEEP_INTERVAL_S": "2",  # what a pass leaves (check_store waits for it)
}
STEPS = 10


@pytest.fixture(scope="module")
def states() -> list[dict[str, Any]]:
    return training_states(STEPS + 1)


def check_run(
    client: CheckpointClient, run: str, states: list[dict[str, Any]], steps: list[int]
) -> None:
    """The run holds exactly ``steps``, each loading to its state; ``latest`` is the last."""
    assert [i.step for i in client.list(run)] == steps
    for step in steps:
        assert_same_state(states[step], client.load(run, step), path=f"step {step}")
    assert_same_state(states[steps[-1]], client.load(run), path="latest")


def saved_and_stopped(
    make_service: Callable[..., Service], data: Path, states: list[dict[str, Any]]
) -> tuple[Service, CheckpointClient]:
    """Run "f" holding ``states`` (steps 0, 1, ...), saved through a service on ``data``
    that is then stopped, so that the test can open its runtime (:func:`runtime_of`);
    returns the service (to start again) and its client."""
    svc = make_service(env=ENV, data_dir=data)
    client = CheckpointClient(svc.url)
    for step, state in enumerate(states):
        client.save("f", step, state)
    svc.stop()
    return svc, client


def runtime_of(data: Path) -> Runtime:
    """The service's runtime on ``data``, in the test's process."""
    return Runtime.open(Settings(data_dir=data, chunk_bytes=64 << 10))


def test_delete_anywhere_in_a_chain_keeps_the_rest_exact(
    make_service: Callable[..., Service], states: list[dict[str, Any]]
) -> None:
    svc = make_service(env=ENV)
    client = CheckpointClient(svc.url)
    for step in range(STEPS):
        client.save("r", step, states[step])
    infos = {i.step: i for i in client.list("r")}
    assert [s for s, i in infos.items() if i.keyframe] == [0, 4, 8]
    steps = list(range(STEPS))
    stored = check_store(svc, client)
    # the middle of a chain, a keyframe (its successors rested on it), the newest, the oldest
    for gone in (5, 4, 9, 0):
        client.delete("r", gone)
        steps.remove(gone)
        check_run(client, "r", states, steps)
        with pytest.raises(CheckpointNotFound):
            client.load("r", gone)
        now = check_store(svc, client)
        assert now < stored, (gone, now, stored)
        stored = now
    infos = {i.step: i for i in client.list("r")}
    assert infos[6].parent_step == 3 and infos[1].parent_step is None
    assert infos[1].keyframe and infos[1].chain_depth <= 1  # whole now (bf16: casts)
    with pytest.raises(CheckpointNotFound):
        client.delete("r", 5)
    with pytest.raises(RunNotFound):
        client.delete("nope", 1)
    latest = httpx.delete(f"{svc.url}/v1/runs/r/checkpoints/latest")  # a delete names its step
    assert latest.status_code == 400
    assert latest.json()["error"]["code"] == InvalidRequest.code
    # a save after deleting the newest diffs against the new latest
    info = client.save("r", STEPS, states[STEPS])
    assert info.parent_step == 8 and not info.keyframe and info.chain_depth > 0
    assert info.stored_bytes < infos[8].stored_bytes  # a delta of the keyframe at 8
    check_run(client, "r", states, [*steps, STEPS])
    # after a restart (no base cache: every load decodes from storage)
    svc.stop()
    forget_cache(svc.data_dir)
    svc.start()
    check_run(client, "r", states, [*steps, STEPS])


def test_delete_a_run(make_service: Callable[..., Service], states: list[dict[str, Any]]) -> None:
    svc = make_service(env=ENV)
    client = CheckpointClient(svc.url)
    for step in range(5):
        client.save("gone", step, states[step])
        client.save("kept", step, states[step])
    client.delete_run("gone")
    with pytest.raises(RunNotFound):
        client.list("gone")
    with pytest.raises(RunNotFound):
        client.delete_run("gone")
    assert [r.name for r in client.runs()] == ["kept"]
    check_run(client, "kept", states, list(range(5)))
    check_store(svc, client)
    assert not any(k.startswith("runs/gone/") for k in blob_files(svc.data_dir))
    # the name starts a fresh chain
    info = client.save("gone", 7, states[7])
    assert info.parent_step is None and info.keyframe
    check_run(client, "gone", states, [7])


def test_delete_in_a_rerooted_chain(
    make_service: Callable[..., Service], states: list[dict[str, Any]]
) -> None:
    """After a re-root, checkpoints before the root are deltas of later ones: deleting the
    root re-bases both sides."""
    env = {**ENV, "CKPTSTORE_REROOT_DEPTH": "4", "CKPTSTORE_KEYFRAME_INTERVAL": "100"}
    svc = make_service(env=env)
    client = CheckpointClient(svc.url)
    for step in range(8):
        client.save("rr", step, states[step])
    wait_idle(svc.url)
    infos = client.list("rr")
    root = min(infos, key=lambda i: i.chain_depth).step
    assert root > 0  # re-rooted: the chain runs both ways from it
    steps = list(range(8))
    for gone in (root, root - 1):
        client.delete("rr", gone)
        steps.remove(gone)
        check_run(client, "rr", states, steps)
        check_store(svc, client)


def test_loads_during_deletes_are_exact_or_not_found(
    make_service: Callable[..., Service], database_url: str, states: list[dict[str, Any]]
) -> None:
    """Loads of every step race the deletes (grace time at its default): each one is the
    exact state, or CheckpointNotFound for a step being or having been deleted."""
    env = {**ENV, "CKPTSTORE_DATABASE_URL": database_url, "CKPTSTORE_GARBAGE_GRACE_S": "3600"}
    svc = make_service(env=env)
    client = CheckpointClient(svc.url)
    for step in range(STEPS):
        client.save("l", step, states[step])
    doomed: set[int] = set()  # steps whose delete has begun
    done = threading.Event()
    errors: list[BaseException] = []
    counts = {"exact": 0, "gone": 0}

    def loader(seed: int) -> None:
        rng = random.Random(seed)
        reader = CheckpointClient(svc.url)
        try:
            while not done.is_set():
                step = rng.randrange(STEPS)
                try:
                    got = reader.load("l", step)
                except CheckpointNotFound:
                    assert step in doomed, f"step {step} was not deleted"
                    counts["gone"] += 1
                    continue
                assert_same_state(states[step], got, path=f"step {step}")
                counts["exact"] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=loader, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        for gone in (3, 6, 9, 0, 1):
            wait_until(lambda n=counts["exact"] + 4: counts["exact"] >= n or bool(errors), 60)
            doomed.add(gone)
            client.delete("l", gone)
    finally:
        done.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[0]
    assert counts["exact"] >= 20
    check_run(client, "l", states, [2, 4, 5, 7, 8])


def test_a_load_of_latest_whose_checkpoint_is_deleted_meanwhile_serves_the_new_latest(
    make_service: Callable[..., Service], tmp_path: Path, states: list[dict[str, Any]]
) -> None:
    """The newest checkpoint is deleted between a load of ``latest`` resolving it and
    reading its rows: the load serves the new latest, not ``checkpoint_not_found`` for a
    run that has checkpoints (a loader of two replicas saw that while deletes ran). The
    same for ``latest/info``, which answered the deleted checkpoint with no tensors."""
    data = tmp_path / "data"
    svc, client = saved_and_stopped(make_service, data, states[:3])
    rt = runtime_of(data)
    try:
        policy = RerootPolicy.of(rt.settings, rt.budget)
        resolve = rt.catalog.get
        deleted: list[int] = []
        deletes = [1]  # how many more resolutions of latest are followed by a delete

        def resolve_then_delete(run: str, step: int | None) -> CheckpointRecord:
            info = resolve(run, step)
            if step is None and deletes[0]:  # the delete commits right after
                deletes[0] -= 1
                delete_checkpoint(
                    rt.catalog,
                    rt.store,
                    run,
                    info.step,
                    policy,
                    scratch=rt.cache.scratch,
                    pool=rt.pool,
                )
                deleted.append(info.step)
            return info

        rt.catalog.get = resolve_then_delete  # type: ignore[method-assign]
        served = rt.loader.open("f", None, None)
        assert deleted == [2] and served.info.step == 1
        body = b"".join(bytes(piece) for piece in served.body)
        rt.catalog.get = resolve  # type: ignore[method-assign]
        assert body == b"".join(bytes(piece) for piece in rt.loader.open("f", 1, None).body)

        rt.catalog.get = resolve_then_delete  # type: ignore[method-assign]
        deletes[0] = 1
        info = asyncio.run(checkpoint_info("f", "latest", rt))
        assert deleted == [2, 1] and info["checkpoint"]["step"] == 0
        assert len(info["tensors"]) == resolve("f", 0).tensors > 0
    finally:
        rt.close()
    svc.start()
    check_run(client, "f", states, [0])


def test_sigkill_during_a_delete_loses_nothing(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    """SIGKILL once the delete's new blobs are named (its re-base is writing them): after a
    restart the deleted checkpoint is either whole or gone, every other one loads exactly,
    and a collection leaves exactly the blobs the catalog names."""
    torch.manual_seed(5)
    w = torch.randn(1 << 21)
    frozen = torch.randn(1 << 21)  # its refs rest on step 0: every later blob is rewritten
    states = []
    for _ in range(4):
        w += 1e-3 * torch.randn_like(w)
        states.append({"w": w.clone(), "frozen": frozen.clone()})
    data = tmp_path / "data"
    env = {**ENV, "CKPTSTORE_CHUNK_BYTES": str(1 << 20), "CKPTSTORE_KEYFRAME_INTERVAL": "100"}
    svc = make_service(env=env, data_dir=data)
    client = CheckpointClient(svc.url)
    for step, state in enumerate(states):
        client.save("k", step, state)
    db = data / "catalog.sqlite3"
    before = set(blob_files(data))
    answer: list[object] = []

    def delete() -> None:
        try:
            answer.append(httpx.delete(f"{svc.url}/v1/runs/k/checkpoints/0", timeout=60))
        except httpx.TransportError as exc:
            answer.append(exc)

    thread = threading.Thread(target=delete)
    thread.start()
    # the new blobs are named on the garbage table before the first is written
    wait_until(lambda: garbage_blobs(db) - before or answer, 30, interval=0.002)
    svc.kill()
    thread.join(60)
    assert isinstance(answer[0], httpx.TransportError), "the delete ended before the kill"
    svc.start()
    steps = [i.step for i in client.list("k")]
    assert steps in ([0, 1, 2, 3], [1, 2, 3])
    for step in steps:
        assert_same_state(states[step], client.load("k", step), path=f"step {step}")
    svc.stop()
    named = catalog_blobs(db)
    assert set(blob_files(data)) <= named | garbage_blobs(db)
    collect_all(data)  # the new blobs' rows are due once a crashed upload's time is over
    assert set(blob_files(data)) == named
    svc.start()
    if steps[0] == 0:
        client.delete("k", 0)
    check_run(client, "k", states, [1, 2, 3])
    check_store(svc, client)


def test_ckptstore_rm(
    make_service: Callable[..., Service],
    states: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``ckptstore rm RUN@STEP`` deletes a checkpoint; ``rm RUN`` a whole run, with --yes."""
    svc = make_service(env=ENV)
    client = CheckpointClient(svc.url)
    for step in range(3):
        client.save("c", step, states[step])
        client.save("d", step, states[step])
    assert main(["rm", "--url", svc.url, "c@1"]) == 0
    assert capsys.readouterr().out == "deleted c@1\n"
    check_run(client, "c", states, [0, 2])
    assert main(["rm", "--url", svc.url, "d"]) == 1  # a whole run needs --yes
    assert "add --yes" in capsys.readouterr().err
    check_run(client, "d", states, [0, 1, 2])
    assert main(["rm", "--url", svc.url, "d", "--yes"]) == 0
    assert capsys.readouterr().out == "deleted run d\n"
    with pytest.raises(RunNotFound):
        client.list("d")
    assert main(["rm", "--url", svc.url, "c@1"]) == 1
    assert "no checkpoint at step 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["rm", "--url", svc.url, "c@latest"])
    assert usage.value.code == 2
    assert "names its step" in capsys.readouterr().err


def test_delete_checkpoints_written_in_parts(make_service: Callable[..., Service]) -> None:
    """Chunks live in the parts' blobs: re-basing rewrites those (the catalog names every
    blob after), and a delete waits for a checkpoint being written in parts to commit."""
    svc = make_service(env={**ENV, "CKPTSTORE_DELETE_PARTS_WAIT_S": "60"})
    client = CheckpointClient(svc.url)
    expected = {}
    for step in range(4):
        bodies = save_in_parts(svc.url, "p", step)
        assert commit(svc.url, "p", step, ["rank-0", "rank-1"]).status_code == 201
        expected[step] = {n: a.tobytes() for body in bodies for n, a in body.items()}
    assert all(i.parts == 2 for i in client.list("p"))
    steps = [0, 1, 2, 3]
    for gone in (1, 0):
        named = catalog_blobs(svc.data_dir / "catalog.sqlite3")
        client.delete("p", gone)
        # the next step's parts rested on it (later ones may too): both blobs written anew
        new = catalog_blobs(svc.data_dir / "catalog.sqlite3") - named
        of_step_2 = [k for k in new if (b := parse_blob_key(k)) and (b.run, b.step) == ("p", 2)]
        assert len(of_step_2) == 2, new
        steps.remove(gone)
        assert [i.step for i in client.list("p")] == steps
        for step in steps:
            got = httpx.get(f"{svc.url}/v1/runs/p/checkpoints/{step}", timeout=60)
            assert tensors_of(got.content) == expected[step], step
        check_store(svc, client)
    save_in_parts(svc.url, "p", 9)  # uploaded, not committed: its parts rest on step 3
    # the delete waits for the commit (CKPTSTORE_DELETE_PARTS_WAIT_S), then re-bases step 9
    deleting = threading.Thread(target=lambda: CheckpointClient(svc.url).delete("p", 3))
    deleting.start()
    assert commit(svc.url, "p", 9, ["rank-0", "rank-1"]).status_code == 201
    deleting.join(60)
    assert not deleting.is_alive() and [i.step for i in client.list("p")] == [2, 9]
    got = httpx.get(f"{svc.url}/v1/runs/p/checkpoints/9", timeout=60)
    assert tensors_of(got.content) == {
        n: a.tobytes() for body in shards(9) for n, a in body.items()
    }
    check_store(svc, client)


@pytest.mark.postgres
@pytest.mark.s3
def test_delete_on_postgres_and_s3(
    make_service: Callable[..., Service],
    backends: dict[str, str],
    states: list[dict[str, Any]],
) -> None:
    """The production backends: blobs rewritten on S3 from S3, and afterwards the bucket
    holds exactly the blobs the catalog names (step 0's shared chunks, the frozen
    embedding's, in a blob of their own among them)."""
    env = {**backends, **{k: v for k, v in ENV.items() if k != "CKPTSTORE_CHUNK_BYTES"}}
    svc = make_service(env=env)
    client = CheckpointClient(svc.url)
    for step in range(6):
        client.save("s3", step, states[step])
    steps = list(range(6))
    for gone in (2, 0):
        client.delete("s3", gone)
        steps.remove(gone)
        check_run(client, "s3", states, steps)
    wait_idle(svc.url)
    catalog = Catalog(backends["CKPTSTORE_DATABASE_URL"])
    try:
        listed = {i.blob_key for i in catalog.list_checkpoints("s3")}
        assert not catalog.garbage(None, datetime.now(UTC) + timedelta(days=1))
    finally:
        catalog.close()
    keys = named_blobs(backends["CKPTSTORE_DATABASE_URL"])
    assert len(keys - listed) == 1  # step 0's shared chunks
    store = s3_store(backends)
    assert set(store.iter_keys("runs/s3/")) == keys


def test_a_failed_delete_changes_nothing_and_leaves_nothing(
    make_service: Callable[..., Service], tmp_path: Path, states: list[dict[str, Any]]
) -> None:
    """The commit fails after the new blobs are written: no row changes, the blobs it wrote
    are deleted and their garbage rows dropped, and the checkpoint can be deleted later."""
    data = tmp_path / "data"
    svc, client = saved_and_stopped(make_service, data, states[:4])
    files = blob_files(data)
    rt = runtime_of(data)
    try:
        before = rt.catalog.list_checkpoints("f")

        def no_commit(*args: Any, **kwargs: Any) -> list[str]:
            assert set(blob_files(data)) > set(files)  # the new blobs are written
            raise StorageUnavailable("injected: the database went away at the commit")

        rt.catalog.commit_delete = no_commit  # type: ignore[method-assign]
        with pytest.raises(StorageUnavailable, match="injected"):
            policy = RerootPolicy.of(rt.settings, rt.budget)
            delete_checkpoint(
                rt.catalog, rt.store, "f", 1, policy, scratch=rt.cache.scratch, pool=rt.pool
            )
        assert rt.catalog.list_checkpoints("f") == before
        assert not garbage_blobs(data / "catalog.sqlite3")
        assert blob_files(data) == files
    finally:
        rt.close()
    svc.start()
    client.delete("f", 1)
    check_run(client, "f", states, [0, 2, 3])
    check_store(svc, client)


def test_uncommitted_parts_do_not_veto_an_admin_delete(
    make_service: Callable[..., Service],
) -> None:
    # one uncommitted part made every delete of its run a 409 run_busy until the parts were
    # abandoned (CKPTSTORE_PARTS_TTL_S, 6 h by default)
    from support.bodies import valid_body

    svc = make_service({**ENV, "CKPTSTORE_DELETE_PARTS_WAIT_S": "1"})
    states = training_states(3)
    with CheckpointClient(svc.url, retries=0) as client:
        for step in range(3):
            client.save("vetoed", step, states[step])
        prefix, data = valid_body(seed=2)
        url = f"{svc.url}/v1/runs/vetoed/checkpoints"
        assert httpx.put(f"{url}/3/parts/rank-0", content=prefix + data).status_code == 201
        answer = httpx.delete(f"{url}/1", timeout=60)
        assert answer.status_code == 204, answer.text
        assert [c.step for c in client.list("vetoed")] == [0, 2]
        for step in (0, 2):
            assert_same_state(states[step], client.load("vetoed", step))
        late = httpx.post(f"{url}/3/commit", json={"parts": ["rank-0"]}, timeout=30)
        assert late.status_code in (400, 404, 409), late.text  # its parts were collected
        assert [c.step for c in client.list("vetoed")] == [0, 2]
        assert httpx.put(f"{url}/4/parts/rank-0", content=prefix + data).status_code == 201
        assert httpx.delete(f"{svc.url}/v1/runs/vetoed", timeout=60).status_code == 204
        with pytest.raises(RunNotFound):
            client.list("vetoed")
