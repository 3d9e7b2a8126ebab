"""Forks (issue 20, items 4 and 5): a new run whose first checkpoint is another run's, made
without copying a byte; its saves are deltas of it; deleting the source checkpoint, the
whole source run or retention on it never changes what the fork loads; the run's record
shows the bytes it owns and those it shares apart; after a collection with grace 0 the blob
store holds exactly what the catalog names. Real service processes, SQLite (and one on
PostgreSQL)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from ckptstore import CheckpointClient
from ckptstore.cli import main
from ckptstore_core.errors import (
    CheckpointExists,
    CheckpointNotFound,
    InvalidRequest,
    RunNotFound,
)
from support.blobs import blob_files, check_store
from support.parts import commit, save_in_parts, tensors_of
from support.serviceproc import Service, forget_cache, wait_idle
from support.states import assert_same_state, training_states
from support.waiting import wait_until

ENV = {
    "CKPTSTORE_REROOT_DEPTH": "0",
    "CKPTSTORE_KEYFRAME_INTERVAL": "4",  # keyframes at steps 0, 4, 8
    "CKPTSTORE_GARBAGE_GRACE_S": "0",
    "CKPTSTORE_CHUNK_BYTES": str(64 << 10),  # several chunks per tensor, refs of the frozen
    "CKPTSTORE_SWEEP_INTERVAL_S": "2",  # what a pass leaves (check_store waits for it)
}


@pytest.fixture(scope="module")
def states() -> list[dict[str, Any]]:
    return training_states(7)


def check(
    client: CheckpointClient, run: str, states: list[dict[str, Any]], steps: list[int]
) -> None:
    """``run`` holds exactly ``steps``, each loading to its state bit for bit."""
    assert [i.step for i in client.list(run)] == steps
    for step in steps:
        assert_same_state(states[step], client.load(run, step), path=f"{run}@{step}")


def test_fork_fine_tune_and_delete_the_source(
    make_service: Callable[..., Service], states: list[dict[str, Any]]
) -> None:
    svc = make_service(env=ENV)
    client = CheckpointClient(svc.url)
    for step in range(4):
        client.save("base", step, states[step])
    stored = check_store(svc, client)
    before = blob_files(svc.data_dir)

    info = client.fork("base", 3, "ft")
    source = {i.step: i for i in client.list("base")}[3]
    assert (info.run, info.step, info.parent_step) == ("ft", 3, None)
    assert info.raw_bytes == source.raw_bytes and info.stored_bytes == 0
    check(client, "ft", states, [3])
    added = {k: n for k, n in blob_files(svc.data_dir).items() if k not in before}
    assert sum(added.values()) == 0, added  # no byte copied: one empty blob
    assert check_store(svc, client) == stored
    ft, base = client.run_info("ft"), client.run_info("base")
    assert ft.stored_bytes == 0 and ft.shared_bytes > 0
    assert base.stored_bytes == stored and base.shared_bytes == 0
    # ft rests on step 3 and what its chunks rest on: the chain back to the keyframe at 0
    assert ft.shared_bytes <= stored

    # the fine-tune's saves diff against the fork: about a delta, not a full checkpoint
    full = client.save("fresh", 4, states[4]).stored_bytes
    tuned = [client.save("ft", step, states[step]) for step in (4, 5)]
    print(
        f"\nfork: 0 bytes stored for {info.raw_bytes} raw; the fine-tune's first save "
        f"{tuned[0].stored_bytes} bytes against {full} for the same state saved whole "
        f"({tuned[0].stored_bytes / full:.2f}x; a delta in the source run: "
        f"{source.stored_bytes}); second {tuned[1].stored_bytes}"
    )
    assert tuned[0].parent_step == 3 and not tuned[0].keyframe
    # as much as a delta of the source run (its step 3 is one of step 2), far from whole
    assert tuned[0].stored_bytes <= 1.2 * source.stored_bytes
    assert tuned[0].stored_bytes < 0.75 * full
    check(client, "ft", states, [3, 4, 5])

    # deleting the source checkpoint, then the whole source run: the fork keeps its bytes
    client.delete("base", 3)
    check(client, "ft", states, [3, 4, 5])
    check(client, "base", states, [0, 1, 2])
    check_store(svc, client)
    client.delete_run("base")
    with pytest.raises(RunNotFound):
        client.list("base")
    check(client, "ft", states, [3, 4, 5])
    check_store(svc, client)
    assert not any(k.startswith("runs/base/") for k in blob_files(svc.data_dir))
    ft = client.run_info("ft")
    assert ft.shared_bytes == 0 and ft.stored_bytes == ft.record.stored_bytes > 0
    # the fork's chains were re-based: a restart without the base cache decodes them
    svc.stop()
    forget_cache(svc.data_dir)
    svc.start()
    check(client, "ft", states, [3, 4, 5])
    client.save("ft", 6, states[6])
    check(client, "ft", states, [3, 4, 5, 6])
    check_store(svc, client)


def test_retention_on_the_source_keeps_the_fork(
    make_service: Callable[..., Service], states: list[dict[str, Any]]
) -> None:
    svc = make_service(env=ENV)
    client = CheckpointClient(svc.url)
    for step in range(6):
        client.save("src", step, states[step])
    client.fork("src", 2, "f2")
    client.fork("f2", 2, "f3")  # a fork of a fork: its refs point at src's chunks too
    client.set_retention("src", keep_last=1)
    wait_until(lambda: [i.step for i in client.list("src")] == [5], 30)
    check(client, "f2", states, [2])
    check(client, "f3", states, [2])
    check_store(svc, client)
    client.delete_run("f2")
    check(client, "f3", states, [2])
    check_store(svc, client)


def maintenance_errors(url: str) -> float:
    """``ckptstore_maintenance_runs_total{outcome="error"}`` of a service, all tasks."""
    lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("ckptstore_maintenance_runs_total{") and 'outcome="error"' in line
    )


def test_reroots_on_either_side_of_a_fork(
    make_service: Callable[..., Service], states: list[dict[str, Any]]
) -> None:
    """A re-root of the source rewrites chunks the fork refers to (ids and bytes kept); one
    of the fork would reverse chains into the source's blobs, so it is skipped. Nothing
    fails, and every checkpoint stays exact."""
    env = {**ENV, "CKPTSTORE_REROOT_DEPTH": "3", "CKPTSTORE_KEYFRAME_INTERVAL": "100"}
    svc = make_service(env=env)
    client = CheckpointClient(svc.url)
    for step in range(3):
        client.save("s", step, states[step])
    client.fork("s", 2, "f")
    for step in range(3, 7):
        client.save("s", step, states[step])
        client.save("f", step, states[step])
    wait_idle(svc.url)
    assert min(i.chain_depth for i in client.list("s")) > 0  # s was re-rooted
    assert maintenance_errors(svc.url) == 0
    check(client, "s", states, list(range(7)))
    check(client, "f", states, list(range(2, 7)))
    client.delete_run("s")
    check(client, "f", states, list(range(2, 7)))
    check_store(svc, client)


def test_fork_of_a_checkpoint_written_in_parts(make_service: Callable[..., Service]) -> None:
    """The source's chunks live in its parts' blobs: the fork refers to them, and keeps its
    bytes when the source run goes (the re-base writes them into the fork's own blob)."""
    svc = make_service(env=ENV)
    client = CheckpointClient(svc.url)
    expected = {}
    for step in range(2):
        bodies = save_in_parts(svc.url, "p", step)
        assert commit(svc.url, "p", step, ["rank-0", "rank-1"]).status_code == 201
        expected[step] = {n: a.tobytes() for body in bodies for n, a in body.items()}
    info = client.fork("p", 1, "pf")
    assert info.stored_bytes == 0

    def pf() -> dict[str, bytes]:
        got = httpx.get(f"{svc.url}/v1/runs/pf/checkpoints/1", timeout=60)
        got.raise_for_status()
        return tensors_of(got.content)

    assert pf() == expected[1]
    check_store(svc, client)
    client.delete_run("p")
    assert pf() == expected[1]
    assert client.run_info("pf").stored_bytes > 0
    check_store(svc, client)


def test_bad_forks_change_nothing(
    make_service: Callable[..., Service],
    states: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    svc = make_service(env=ENV)
    client = CheckpointClient(svc.url)
    for step in range(2):
        client.save("a", step, states[step])
    client.save("taken", 0, states[0])
    stored = check_store(svc, client)
    runs = client.runs()
    with pytest.raises(RunNotFound):
        client.fork("nope", 0, "x")
    with pytest.raises(CheckpointNotFound):
        client.fork("a", 7, "x")
    with pytest.raises(CheckpointExists):
        client.fork("a", 1, "taken")
    with pytest.raises(InvalidRequest):
        client.fork("a", 1, "a")  # into itself
    with pytest.raises(InvalidRequest):
        client.fork("a", 1, "bad name!")  # refused before anything is sent
    for body in (
        {"from_run": "../a", "from_step": 1},
        {"from_run": "a", "from_step": -1},
        {"from_run": "a"},
        {"from_run": "a", "from_step": 1, "extra": 1},
    ):
        answer = httpx.post(f"{svc.url}/v1/runs/x/fork", json=body)
        assert answer.status_code in (400, 422), (body, answer.text)
        assert answer.json()["error"]["code"] == InvalidRequest.code, answer.text
    answer = httpx.post(f"{svc.url}/v1/runs/x/fork", json={"from_run": "nope", "from_step": 0})
    assert (answer.status_code, answer.json()["error"]["code"]) == (404, "run_not_found")
    assert client.runs() == runs
    assert check_store(svc, client) == stored
    # a retry of a fork that was made (its answer lost) is answered as done
    first = httpx.post(f"{svc.url}/v1/runs/b/fork", json={"from_run": "a", "from_step": 1})
    again = httpx.post(f"{svc.url}/v1/runs/b/fork", json={"from_run": "a", "from_step": 1})
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json() == again.json()
    other = httpx.post(f"{svc.url}/v1/runs/b/fork", json={"from_run": "a", "from_step": 0})
    assert other.status_code == 409
    # the CLI
    assert main(["fork", "--url", svc.url, "a@0", "c"]) == 0
    assert capsys.readouterr().out.startswith("forked a@0 into c@0: ")
    check(client, "c", states, [0])
    assert main(["fork", "--url", svc.url, "a@0", "c"]) == 0  # the same fork: done
    capsys.readouterr()
    assert main(["fork", "--url", svc.url, "a@1", "c"]) == 1
    assert "has checkpoints already" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["fork", "--url", svc.url, "a", "d"])
    assert usage.value.code == 2


@pytest.mark.postgres
def test_fork_on_postgres_saves_race_the_sources_deletes(
    make_service: Callable[..., Service], pg_url: str, states: list[dict[str, Any]]
) -> None:
    """On PostgreSQL, the fine-tune saves to the fork while the source's checkpoints and
    then the source run are deleted (each delete waits for the fork's run lock, and re-bases
    what the saves committed meanwhile): every checkpoint of the fork loads exactly."""
    svc = make_service(env={**ENV, "CKPTSTORE_DATABASE_URL": pg_url})
    client = CheckpointClient(svc.url)
    for step in range(4):
        client.save("pg", step, states[step])
    client.fork("pg", 3, "pgf")
    assert client.run_info("pgf").shared_bytes > 0
    errors: list[BaseException] = []

    def fine_tune() -> None:
        try:
            with CheckpointClient(svc.url) as writer:
                for step in range(4, 7):
                    writer.save("pgf", step, states[step])
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=fine_tune)
    thread.start()
    try:
        for step in (3, 2):
            client.delete("pg", step)
        client.delete_run("pg")
    finally:
        thread.join(120)
    assert not errors, errors[0]
    check(client, "pgf", states, [3, 4, 5, 6])
    assert client.run_info("pgf").shared_bytes == 0
