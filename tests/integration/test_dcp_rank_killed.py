"""A rank SIGKILLed in the middle of a distributed save (issue 19): nothing becomes visible,
``latest`` stays where it was, the killed save's parts are collected once the parts TTL has
passed, and the restarted job's next save lands and loads bit for bit -- also a save of the
same step before the TTL, by fewer ranks (its commit deletes the killed attempt's parts).

Three gloo ranks (tests/support/dcp_ranks.py: ``killed_save``) save step 1, then step 2, in
which rank 1 stops for good in the middle of its part's body: the service holds that part
as ``writing`` while the other two ranks' parts are ``done``. The test waits for exactly
that state in the catalog, then SIGKILLs rank 1. The survivors' collectives fail on the
dead peer (gloo sees its connections close) and their ``dcp.save`` raises; rank 0, the
coordinator, never commits.

The service keeps the default parts TTL (6 h) and sweeps every 0.2 s (the sweep runs
throughout the saves and must leave parts being uploaded alone), so the state the crash left
is checked before anything could be collected by age; the test then lets the TTL pass for
the abandoned checkpoint by moving its ``created_at`` back (the clock the TTL is measured
by: what a short TTL would race with), and the next sweep collects it.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import torch
from sqlalchemy import Engine, create_engine, select, text, update

from ckptstore import CheckpointClient
from ckptstore_service.catalog.models import PARTS, Checkpoint, Run
from ckptstore_service.names import parse_blob_key
from ckptstore_service.settings import Settings
from support import dcp_ranks
from support.serviceproc import Service
from support.states import assert_same_state
from support.waiting import wait_until

WORLD, VICTIM = 3, 1
RUN = "killed"
SURVIVORS = [f"rank-{r}" for r in range(WORLD) if r != VICTIM]
# how long the survivors' collectives may wait for the dead rank (gloo notices the closed
# connections at once; a peer that vanished without closing them takes this long)
GROUP_TIMEOUT_S = 20.0
PARTS_TTL_S = Settings().parts_ttl_s  # the default the service runs with


@dataclass(frozen=True)
class StepRows:
    """The catalog's rows of a checkpoint (``status`` None: no row)."""

    status: str | None = None
    parts: dict[str, str] = field(default_factory=dict)  # part name -> status
    blob_keys: frozenset[str] = frozenset()
    tensor_rows: int = 0
    chunk_rows: int = 0

    def by_rank(self) -> dict[str, str]:
        """Part statuses by rank (``rank-1``: a DCP part's name without its save's token)."""
        return {name.split(".")[0]: status for name, status in self.parts.items()}


def step_rows(engine: Engine, step: int) -> StepRows:
    """What the catalog holds of ``RUN/step``, read with plain SQL (no service code)."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT c.id, c.status FROM checkpoints c JOIN runs r ON r.id = c.run_id"
                " WHERE r.name = :run AND c.step = :step"
            ),
            {"run": RUN, "step": step},
        ).first()
        if row is None:
            return StepRows()
        checkpoint_id, status = row
        parts = conn.execute(
            text("SELECT name, status, blob_key FROM parts WHERE checkpoint_id = :id"),
            {"id": checkpoint_id},
        ).all()

        def count(table: str) -> int:
            query = text(f"SELECT count(*) FROM {table} WHERE checkpoint_id = :id")
            return int(conn.execute(query, {"id": checkpoint_id}).scalar_one())

        return StepRows(
            status,
            {name: part_status for name, part_status, _ in parts},
            frozenset(key for _, _, key in parts),
            count("tensors"),
            count("chunks"),
        )


def blobs_of_step(data_dir: Path, step: int) -> set[str]:
    """Keys of ``RUN/step``'s blobs in the blob folder, and any write still in progress."""
    root = data_dir / "blobs"
    found = {
        key
        for p in root.glob(f"runs/{RUN}/*.blob")
        if (parsed := parse_blob_key(key := p.relative_to(root).as_posix())) and parsed.step == step
    }
    tmp = root / ".tmp"
    return found | ({p.name for p in tmp.iterdir()} if tmp.is_dir() else set())


def age_by(engine: Engine, step: int, age: timedelta) -> None:
    """Move the ``created_at`` of the uncommitted checkpoint ``RUN/step`` back by ``age``:
    that much time passes for the parts TTL, which counts from it."""
    run_id = select(Run.id).where(Run.name == RUN).scalar_subquery()
    where = (Checkpoint.run_id == run_id, Checkpoint.step == step, Checkpoint.status == PARTS)
    with engine.begin() as conn:
        created = conn.execute(select(Checkpoint.created_at).where(*where)).scalar_one()
        conn.execute(update(Checkpoint).where(*where).values(created_at=created - age))


def latest_step(url: str) -> int:
    answer = httpx.get(f"{url}/v1/runs/{RUN}/checkpoints/latest/info", timeout=30)
    step: int = answer.json()["checkpoint"]["step"]
    return step


def kill_a_rank_mid_save(svc: Service, engine: Engine, out: Path) -> dict[int, int | None]:
    """Run ``killed_save`` on WORLD ranks; once the victim's part of step 2 is in progress
    and the others' are done, SIGKILL the victim. Returns every rank's exit code (a
    survivor still alive after GROUP_TIMEOUT_S and a margin is killed: None)."""
    context = dcp_ranks.start(
        dcp_ranks.killed_save, WORLD, svc.url, RUN, str(out), VICTIM, GROUP_TIMEOUT_S
    )
    codes: dict[int, int | None] = {}
    try:
        in_progress = dict.fromkeys(SURVIVORS, "done") | {f"rank-{VICTIM}": "writing"}
        seen: list[dict[str, str]] = [{}]

        def victim_mid_part() -> bool:
            seen[0] = step_rows(engine, 2).by_rank()
            return seen[0] == in_progress

        # three ranks import torch, form a group and save step 1 first: on a loaded 2-core
        # machine with a cold page cache that alone took over a minute
        try:
            wait_until(victim_mid_part, timeout=180)
        except AssertionError:
            alive = [p.exitcode is None for p in context.processes]
            raise AssertionError(
                f"rank {VICTIM}'s part of step 2 never seen uploading with the others' done:"
                f" last parts {seen[0]}, ranks alive {alive}, files {sorted(os.listdir(out))};"
                f" the service's log ends:\n{svc.log.read_text()[-3000:]}"
            ) from None
        os.kill(context.processes[VICTIM].pid, signal.SIGKILL)
        for rank, proc in enumerate(context.processes):
            proc.join(GROUP_TIMEOUT_S + 10)
            codes[rank] = proc.exitcode
    finally:
        for proc in context.processes:  # what a launcher does to a job that lost a rank
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    return codes


def _full(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def assert_killed_save_left(svc: Service, engine: Engine, out: Path, codes: dict[int, Any]):
    """The victim died of the SIGKILL, the survivors' ``dcp.save`` raised and they exited;
    nothing of step 2 is visible, and the catalog holds the survivors' finished parts
    (invisible) and nothing of the victim's cut upload. Returns those rows."""
    assert codes == {r: -signal.SIGKILL if r == VICTIM else 1 for r in range(WORLD)}
    assert sorted(p.name for p in out.glob("failed-*.txt")) == [
        f"failed-{r}.txt" for r in range(WORLD) if r != VICTIM
    ]
    assert not list(out.glob("saved-*.txt"))
    with CheckpointClient(svc.url) as client:
        assert [c.step for c in client.list(RUN)] == [1]
    assert latest_step(svc.url) == 1
    left = wait_until(
        lambda: (now := step_rows(engine, 2)).by_rank() == dict.fromkeys(SURVIVORS, "done") and now,
        what="the service dropped the victim's cut part",
    )
    assert left.status == "parts" and left.tensor_rows > 0 and left.chunk_rows > 0
    return left


def assert_resaved(svc: Service, out: Path) -> None:
    """The restarted job resumed from step 1 and its step 2 loads bit for bit."""
    assert json.loads((out / "resumed-from.json").read_text()) == 1
    with CheckpointClient(svc.url) as client:
        assert [c.step for c in client.list(RUN)] == [1, 2]
        assert_same_state(_full(out / "full-2.pt"), client.load(RUN, 2))
    assert latest_step(svc.url) == 2


def test_a_rank_killed_mid_save_leaves_nothing_and_the_next_save_lands(
    make_service: Callable[..., Service], database_url: str, tmp_path: Path
) -> None:
    data, out = tmp_path / "data", tmp_path / "out"
    out.mkdir()
    env = {"CKPTSTORE_DATABASE_URL": database_url, "CKPTSTORE_SWEEP_INTERVAL_S": "0.2"}
    svc = make_service(env, data)
    engine = create_engine(database_url)
    try:
        codes = kill_a_rank_mid_save(svc, engine, out)
        left = assert_killed_save_left(svc, engine, out, codes)
        assert blobs_of_step(data, 2) == left.blob_keys

        # the TTL passes: the next sweep collects the abandoned save, rows and blobs
        age_by(engine, 2, timedelta(seconds=PARTS_TTL_S + 60))
        wait_until(
            lambda: step_rows(engine, 2) == StepRows() and not blobs_of_step(data, 2),
            timeout=30,
            what="the abandoned save's rows and blobs collected",
        )
        assert latest_step(svc.url) == 1

        dcp_ranks.launch(dcp_ranks.resumed_save, WORLD, svc.url, RUN, str(out), 2)
        assert_resaved(svc, out)
    finally:
        engine.dispose()


def test_the_restarted_job_saves_the_same_step_at_once_on_fewer_ranks(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    """A job that lost a rank restarts on the ranks left and saves step 2 again before the
    TTL: other shards under the killed attempt's rank numbers (it once met that attempt's
    finished parts and failed: "part 'rank-0' of killed/2 holds other data"). Its commit
    deletes the killed attempt's parts."""
    data, out = tmp_path / "data", tmp_path / "out"
    out.mkdir()
    svc = make_service(None, data)
    engine = create_engine(f"sqlite:///{data / 'catalog.sqlite3'}")
    try:
        codes = kill_a_rank_mid_save(svc, engine, out)
        killed = assert_killed_save_left(svc, engine, out, codes)
        dcp_ranks.launch(dcp_ranks.resumed_save, WORLD - 1, svc.url, RUN, str(out), 2)
        assert_resaved(svc, out)
        saved = step_rows(engine, 2)
        assert saved.status == "committed"
        assert saved.by_rank() == {f"rank-{r}": "done" for r in range(WORLD - 1)}
        assert not set(saved.parts) & set(killed.parts)  # the killed attempt's are gone
        assert blobs_of_step(data, 2) == saved.blob_keys
    finally:
        engine.dispose()
