"""Pins and retention policies (issue 20, items 2 and 3's pins), end to end on real services:
exactly the steps a policy keeps remain, every one loads bit-exactly, stored bytes shrink
and the blob store ends up holding exactly what the catalog names; pins survive retention
and refuse deletes; two replicas on one PostgreSQL applying the same policy at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from ckptstore import CheckpointClient
from ckptstore.cli import main
from ckptstore_core.errors import CheckpointNotFound, CheckpointPinned, RunNotFound
from ckptstore_core.retention import KeepBest, RetentionPolicy
from support.blobs import blob_files, check_store
from support.serviceproc import Service, forget_cache, wait_idle
from support.states import assert_same_state, training_states
from support.waiting import wait_until

ENV = {
    "CKPTSTORE_REROOT_DEPTH": "0",
    "CKPTSTORE_REROOT_QUIET_S": "0",
    "CKPTSTORE_GARBAGE_GRACE_S": "0",
    "CKPTSTORE_KEYFRAME_INTERVAL": "8",
    "CKPTSTORE_CHUNK_BYTES": str(64 << 10),
}
STEPS = 30
NAMED_BLOBS = "SELECT blob_key FROM checkpoints UNION SELECT blob_key FROM parts"


@pytest.fixture(scope="module")
def states() -> list[dict[str, Any]]:
    return training_states(STEPS)


def steps_of(client: CheckpointClient, run: str) -> list[int]:
    return [i.step for i in client.list(run)]


def check_loads(
    client: CheckpointClient, run: str, states: list[dict[str, Any]], steps: list[int]
) -> None:
    """The run holds exactly ``steps``, each loading to its state; ``latest`` is the last."""
    assert steps_of(client, run) == steps
    for step in steps:
        assert_same_state(states[step], client.load(run, step), path=f"{run}@{step}")
    assert_same_state(states[steps[-1]], client.load(run), path=f"{run}@latest")


def retention_passes(url: str, outcome: str) -> float:
    """``ckptstore_maintenance_runs_total{task="retention", outcome=...}`` of a service."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("ckptstore_maintenance_runs_total{") and (
            'task="retention"' in line and f'outcome="{outcome}"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no retention/{outcome} series at {url}/metrics")


def test_keep_last_and_every_on_a_thirty_checkpoint_run(
    make_service: Callable[..., Service], states: list[dict[str, Any]]
) -> None:
    svc = make_service(env=ENV)
    client = CheckpointClient(svc.url)
    expected = [0, 10, 20, 27, 28, 29]
    # "after": thirty saves, then the policy (applied at once); "during": the policy first,
    # applied in the background after each save
    client.set_retention("during", keep_last=3, keep_every=10)
    for step in range(STEPS):
        client.save("after", step, states[step])
        client.save("during", step, states[step])
    wait_idle(svc.url)
    check_loads(client, "during", states, expected)
    assert steps_of(client, "after") == list(range(STEPS))  # no policy: everything stays
    before = check_store(svc, client)
    after_before = next(r.stored_bytes for r in client.runs() if r.name == "after")

    stored = client.set_retention("after", keep_last=3, keep_every=10)
    assert stored == RetentionPolicy(keep_last=3, keep_every=10)
    wait_idle(svc.url)
    check_loads(client, "after", states, expected)
    total = check_store(svc, client)
    after_now = next(r.stored_bytes for r in client.runs() if r.name == "after")
    print(f"\nretention keep_last=3 keep_every=10 on 30 checkpoints: {after_before} -> "
          f"{after_now} stored bytes")  # fmt: skip
    assert total < before and after_now < after_before / 2
    # a resume from the latest, bit-exact, also after a restart (nothing cached)
    svc.stop()
    forget_cache(svc.data_dir)
    svc.start()
    assert_same_state(states[29], client.load("after"), path="resume")
    info = client.run_info("after")
    assert info.record.checkpoints == len(expected) and info.record.latest_step == 29
    assert info.retention == info.effective_retention == RetentionPolicy(3, 10)


def test_keep_best_by_metadata_and_pins(
    make_service: Callable[..., Service], states: list[dict[str, Any]]
) -> None:
    svc = make_service(env=ENV)
    client = CheckpointClient(svc.url)
    losses = [0.9, 0.5, 0.7, 0.2, 0.6, 0.3, None, 0.8, 0.25, 0.95, None, 0.99]
    for step, loss in enumerate(losses):
        metadata = {"note": "no loss"} if loss is None else {"eval_loss": loss, "epoch": step}
        client.save("b", step, states[step], metadata=metadata)
    pinned = client.pin("b", 2)
    assert pinned.pinned and pinned.step == 2
    assert [i.step for i in client.list("b") if i.pinned] == [2]
    # the 3 lowest eval_loss (3, 8, 5), the newest (11), the pinned (2)
    client.set_retention("b", keep_best=("eval_loss", "min", 3))
    wait_idle(svc.url)
    check_loads(client, "b", states, [2, 3, 5, 8, 11])
    check_store(svc, client)

    # a pinned checkpoint refuses deletes, by hand and of its whole run
    with pytest.raises(CheckpointPinned, match="unpin"):
        client.delete("b", 2)
    with pytest.raises(CheckpointPinned):
        client.delete_run("b")
    check_loads(client, "b", states, [2, 3, 5, 8, 11])
    answer = httpx.delete(f"{svc.url}/v1/runs/b/checkpoints/2")
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "checkpoint_pinned"
    detail = client.run_info("b")
    assert detail.pinned == [2]
    assert detail.retention == RetentionPolicy(keep_best=KeepBest("eval_loss", "min", 3))

    # unpinned, retention takes it at once; the highest loss now (max mode) keeps others
    assert not client.unpin("b", 2).pinned
    wait_idle(svc.url)
    check_loads(client, "b", states, [3, 5, 8, 11])
    client.set_retention("b", keep_best=KeepBest("epoch", "max", 1), keep_last=2)
    wait_idle(svc.url)
    check_loads(client, "b", states, [8, 11])  # epoch 8 is the highest left; 11 has none
    check_store(svc, client)

    # typed errors
    with pytest.raises(CheckpointNotFound):
        client.pin("b", 3)
    with pytest.raises(RunNotFound):
        client.pin("nope", 1)
    with pytest.raises(RunNotFound):
        client.run_info("nope")
    with pytest.raises(ValueError):
        client.set_retention("b", keep_last=0)  # refused before anything is sent
    for body in ({"keep_last": 0}, {"keep_forever": 1}, {"keep_best": {"metric": "x"}}):
        answer = httpx.put(f"{svc.url}/v1/runs/b/retention", json=body)
        assert answer.status_code == 400, body
        assert answer.json()["error"]["code"] == "invalid_request"
    assert httpx.put(f"{svc.url}/v1/runs/b/checkpoints/latest/pin").status_code == 400


def test_the_service_default_and_the_cli(
    make_service: Callable[..., Service],
    states: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    svc = make_service(env={**ENV, "CKPTSTORE_RETENTION_KEEP_LAST": "2"})
    client = CheckpointClient(svc.url)
    for step in range(5):
        client.save("d", step, states[step])
    wait_idle(svc.url)
    assert steps_of(client, "d") == [3, 4]  # the default: the newest 2
    info = client.run_info("d")
    assert info.retention is None and info.effective_retention == RetentionPolicy(keep_last=2)

    url = ["--url", svc.url]

    def cli(*args: str) -> str:
        capsys.readouterr()
        assert main([*args, *url]) == 0
        return capsys.readouterr().out

    # a policy of the run's own with no rule keeps everything, whatever the default
    out = cli("retention", "d", "--keep-every", "1")
    assert "keep_every=1" in out
    for step in range(5, 8):
        client.save("d", step, states[step])
    assert "P" not in cli("ls", "d").split("\n", 1)[1]
    assert "pinned" in cli("pin", "d@6")
    table = cli("ls", "d").splitlines()
    assert table[0].split()[-2:] == ["pin", "lossy"]
    assert [line.split()[0] for line in table[1:] if line.split()[-2] == "P"] == ["6"]
    assert {line.split()[-1] for line in table[1:]} == {"-"}  # every one bit-exact
    assert "keep_every=1" in cli("retention", "d")  # shown, not changed
    out = cli("retention", "d", "--clear")  # back to the default: the newest 2, and 6
    assert "keep_last=2" in out
    wait_idle(svc.url)
    assert steps_of(client, "d") == [6, 7]
    cli("unpin", "d@6")
    cli("retention", "d", "--keep-best", "eval_loss:min:1")  # no checkpoint has it
    wait_idle(svc.url)
    assert steps_of(client, "d") == [7]
    assert_same_state(states[7], client.load("d"), path="d@latest")
    capsys.readouterr()
    assert main(["retention", "d", "--clear", "--keep-last", "1", *url]) == 2
    with pytest.raises(SystemExit) as usage:  # a pin names its step
        main(["pin", "d@latest", *url])
    assert usage.value.code == 2
    assert main(["pin", "d@99", *url]) == 1
    assert "no checkpoint at step 99" in capsys.readouterr().err


@pytest.mark.postgres
def test_two_replicas_apply_the_same_policy_at_once(
    make_service: Callable[..., Service],
    pg_url: str,
    tmp_path: Path,
    states: list[dict[str, Any]],
) -> None:
    """Two services on one PostgreSQL and one blob folder get the same policy at the same
    moment: each applies it; exactly the kept steps remain, each loads exactly through
    either, and after the collection the blobs are exactly those the catalog names."""
    shared = tmp_path / "shared"  # its blobs/ folder: both replicas' store
    env = {
        **ENV,
        "CKPTSTORE_DATABASE_URL": pg_url,
        "CKPTSTORE_BLOB_URL": (shared / "blobs").as_uri(),
        "CKPTSTORE_SWEEP_INTERVAL_S": "1",
    }
    a, b = make_service(env=env), make_service(env=env)
    ca, cb = CheckpointClient(a.url), CheckpointClient(b.url)
    for step in range(16):
        (ca if step % 2 else cb).save("pg", step, states[step])
    ca.pin("pg", 5)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def put(client: CheckpointClient) -> None:
        try:
            barrier.wait(10)
            client.set_retention("pg", keep_last=3, keep_every=4)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(c,)) for c in (ca, cb)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    wait_idle(a.url)
    wait_idle(b.url)
    expected = [0, 4, 5, 8, 12, 13, 14, 15]
    check_loads(ca, "pg", states, expected)
    check_loads(cb, "pg", states, expected)

    # then saves through both replicas, each followed by the policy's pass on the replica
    # that took it, while a reader loads steps the policy always keeps
    done = threading.Event()
    loads = [0]

    def reader() -> None:
        client = CheckpointClient(a.url)
        try:
            while not done.is_set():
                step = (0, 4, 5, 8)[loads[0] % 4]
                assert_same_state(states[step], client.load("pg", step), path=f"pg@{step}")
                loads[0] += 1
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for step in range(16, 24):
            (ca if step % 2 else cb).save("pg", step, states[step])
    finally:
        done.set()
        thread.join(60)
    assert not errors, errors
    assert loads[0] > 0
    wait_idle(a.url)
    wait_idle(b.url)
    expected = [0, 4, 5, 8, 12, 16, 20, 21, 22, 23]
    check_loads(ca, "pg", states, expected)
    check_loads(cb, "pg", states, expected)
    for svc in (a, b):  # both applied it, and no pass failed
        assert retention_passes(svc.url, "ok") > 0
        assert retention_passes(svc.url, "error") == 0
    # nothing leaked, nothing lost: once collected (each pass collects its run's garbage,
    # the sweep every second what a pass left), the blobs are those the catalog names
    engine = create_engine(pg_url)
    try:

        def collected() -> bool:
            with engine.connect() as conn:
                named = {k for (k,) in conn.execute(text(NAMED_BLOBS)) if k}
                left = conn.execute(text("SELECT count(*) FROM garbage")).scalar_one()
            return left == 0 and set(blob_files(shared)) == named

        wait_until(collected, 30, "the blob folder holds what the catalog names")
    finally:
        engine.dispose()


def test_retention_held_back_by_uncommitted_parts_says_why(
    make_service: Callable[..., Service], states: list[dict[str, Any]]
) -> None:
    # a checkpoint being written in parts holds retention back (its parts may rest on the
    # chunks it would delete): it did nothing, and said so nowhere but an info line
    from support.bodies import valid_body

    svc = make_service(env=ENV)
    client = CheckpointClient(svc.url)
    for step in range(3):
        client.save("busy", step, states[step])
    prefix, data = valid_body(seed=1)
    part = httpx.put(
        f"{svc.url}/v1/runs/busy/checkpoints/3/parts/rank-0", content=prefix + data, timeout=30
    )
    assert part.status_code == 201, part.text
    client.set_retention("busy", keep_last=1)
    wait_idle(svc.url)
    assert steps_of(client, "busy") == [0, 1, 2]
    listing = httpx.get(f"{svc.url}/v1/runs/busy", timeout=30).json()
    why = listing["retention_waiting"]
    assert why is not None and "step 3" in why and "parts" in why, why
    assert "2 checkpoints" in why and "CKPTSTORE_PARTS_TTL_S" in why, why
    assert "retention of 'busy' waits" in svc.log.read_text()
    quiet = httpx.get(f"{svc.url}/v1/runs/busy", timeout=30).json()
    assert quiet["retention_waiting"] == why
    assert client.run_info("busy").retention_waiting == why  # the client's record says it too
    client.save("free", 0, states[0])
    assert httpx.get(f"{svc.url}/v1/runs/free", timeout=30).json()["retention_waiting"] is None
