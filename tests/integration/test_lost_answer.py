"""A save whose commit landed but whose answer was lost (issue 32), on SQLite and PostgreSQL.

The window is reproduced with :meth:`FaultProxy.drop_answers`: the commit (or a plain save's
POST) goes through whole, the service commits, and the connection is reset as its answer
begins. The client asks again; a save reported failed all the same (every answer lost) is
retried whole by the trainer, under a new save token, maybe by another world size: the same
content is accepted without being stored again, other content is a 409 that says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptstore import CheckpointClient, CheckpointExists, ServiceUnavailable
from ckptstore.dcp import CkptStoreWriter, load_full
from support import dcp_ranks
from support.bodies import assert_error
from support.faultproxy import FaultProxy
from support.parts import commit, dcp_layout, part_body, put_part, save_in_parts, shards
from support.s3server import s3_store
from support.serviceproc import Service
from support.states import assert_same_state

FAST = {"retries": 1, "backoff": 0.01}  # two tries: a lost answer, then the asked-again one


@pytest.fixture
def svc(make_service: Callable[..., Service], database_url: str) -> Service:
    return make_service({"CKPTSTORE_DATABASE_URL": database_url})


@pytest.fixture
def proxy(svc: Service) -> Iterator[FaultProxy]:
    with FaultProxy("127.0.0.1", svc.port, http=True) as p:
        yield p


def _state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {
        "w": torch.randn(12, 4),
        "half": torch.randn(6, 3).to(torch.bfloat16),
        "count": torch.tensor(3),
        "config": {"lr": 0.1, "names": ["a", "b"]},
    }


def _save(url: str, run: str, step: int, state: dict[str, Any], grid: int | None = 32) -> None:
    writer = CkptStoreWriter(url, run, step, grid_bytes=grid, **FAST)
    dcp.save(state, storage_writer=writer, no_dist=True)


def _failures(caught: pytest.ExceptionInfo[CheckpointException]) -> list[BaseException]:
    return [e for e, _ in caught.value.failures.values()]


def _blobs(svc: Service, run: str) -> list[str]:
    return sorted(os.listdir(svc.data_dir / "blobs" / "runs" / run))


def _steps(url: str, run: str) -> list[tuple[int, int]]:
    return [(c.step, c.parts) for c in CheckpointClient(url).list(run)]


def test_a_commit_whose_answer_is_lost_is_asked_again(svc: Service, proxy: FaultProxy) -> None:
    proxy.drop_answers(b"/commit", 1)
    _save(proxy.url, "asked", 1, _state())
    assert proxy.answers_dropped == 1
    assert _steps(svc.url, "asked") == [(1, 1)]
    assert_same_state(_state(), CheckpointClient(svc.url).load("asked", 1))


def test_a_save_reported_failed_after_it_landed_is_saved_again(
    svc: Service, proxy: FaultProxy
) -> None:
    """Every answer of the commit is lost: the save fails although it committed. The same
    save again (a new writer: new part names) succeeds and stores nothing; other content
    is refused with a 409 that says why."""
    proxy.drop_answers(b"/commit", 2)
    with pytest.raises(CheckpointException) as caught:
        _save(proxy.url, "landed", 1, _state())
    assert [type(e) for e in _failures(caught)] == [ServiceUnavailable]
    assert "may have landed" in str(_failures(caught)[0])
    assert proxy.answers_dropped == 2
    assert _steps(svc.url, "landed") == [(1, 1)]  # committed all the same
    blobs = _blobs(svc, "landed")

    _save(svc.url, "landed", 1, _state())  # the trainer retries the save
    _save(svc.url, "landed", 1, _state(), grid=None)  # also cut into other pieces
    assert _steps(svc.url, "landed") == [(1, 1)]
    assert _blobs(svc, "landed") == blobs  # nothing stored again

    other = _state()
    other["w"][3, 1] += 1
    with pytest.raises(CheckpointException) as caught:
        _save(svc.url, "landed", 1, other)
    (error,) = _failures(caught)
    assert isinstance(error, CheckpointExists)
    assert "other content" in str(error) and "'w@2,0'" in str(error)
    other = _state()
    other["extra"] = torch.ones(2)
    with pytest.raises(CheckpointException) as caught:
        _save(svc.url, "landed", 1, other)
    assert "'extra@0'" in str(_failures(caught)[0])
    assert_same_state(_state(), CheckpointClient(svc.url).load("landed", 1))


def test_a_plain_save_whose_answer_is_lost_is_retried(svc: Service, proxy: FaultProxy) -> None:
    state = {"w": torch.arange(6.0)}
    proxy.drop_answers(b"POST /v1/runs/plain/checkpoints/4", 1)
    with CheckpointClient(proxy.url, **FAST) as client:
        info = client.save("plain", 4, state)
    assert proxy.answers_dropped == 1 and info.step == 4
    assert _steps(svc.url, "plain") == [(4, 1)]
    assert_same_state(state, CheckpointClient(svc.url).load("plain", 4))


def test_parts_of_a_committed_step_again_under_other_names_and_ranks(svc: Service) -> None:
    """Raw HTTP: a step committed from 2 ranks, sent again by 4 ranks under new part names:
    each part is a 200 (its tensors are regions of the committed ones, compared by
    checksum), the commit is a 200; nothing new is stored. A part or a commit of other
    content is a 409."""
    save_in_parts(svc.url, "again", 1)
    first = commit(svc.url, "again", 1, ["rank-0", "rank-1"], {"dcp": dcp_layout()})
    assert first.status_code == 201, first.text
    blobs = _blobs(svc, "again")
    for ranks in (2, 4):
        names = [f"rank-{r}.retry{ranks}" for r in range(ranks)]
        for name, body in zip(names, shards(1, ranks), strict=True):
            again = put_part(svc.url, "again", 1, name, part_body(body))
            assert again.status_code == 200, again.text
            assert again.json()["tensors"] == 2
        meta = {"dcp": dcp_layout(ranks, parts=names)}
        done = commit(svc.url, "again", 1, names, meta)
        assert done.status_code == 200, done.text
        assert done.json()["step"] == 1 and done.json()["parts"] == 2
    assert _blobs(svc, "again") == blobs
    assert _steps(svc.url, "again") == [(1, 2)]

    changed = put_part(svc.url, "again", 1, "rank-1.x", part_body(shards(2, 4)[0]))
    assert_error(changed, 409, "checkpoint_exists")
    assert "other content" in changed.json()["error"]["message"]
    assert "'w@0,0'" in changed.json()["error"]["message"]
    w = shards(1, 1)[0]["w@0,0"]
    columns = put_part(svc.url, "again", 1, "rank-0.c", part_body({"w@0,8": w[:, 8:16]}))
    assert columns.status_code == 200, columns.text  # a region that is not whole rows
    shifted = put_part(svc.url, "again", 1, "rank-0.x", part_body({"w@0,8": w[:, :8]}))
    assert_error(shifted, 409, "checkpoint_exists")
    bad = commit(
        svc.url, "again", 1, ["rank-0.y"], {"dcp": dcp_layout(2, rows=32, parts=["rank-0.y"] * 2)}
    )
    assert_error(bad, 409, "checkpoint_exists")
    assert_error(commit(svc.url, "again", 1, ["rank-0"]), 409, "checkpoint_exists")
    no_layout = commit(svc.url, "again", 1, ["rank-0.z", "rank-1.z"])
    assert_error(no_layout, 409, "checkpoint_exists")


def test_a_committed_fsdp_step_saved_again_by_another_world_size(
    svc: Service, tmp_path: Path
) -> None:
    """2 FSDP ranks save step 1 (64-byte grid); one process saves the full state it loads
    back as step 1 again, cut otherwise: accepted, nothing stored; changed: a 409."""
    dcp_ranks.launch(dcp_ranks.save_once, 2, svc.url, "fsdp", str(tmp_path), False, 1, 64)
    blobs = _blobs(svc, "fsdp")
    full = load_full(svc.url, "fsdp", 1)
    _save(svc.url, "fsdp", 1, full, grid=None)
    assert _blobs(svc, "fsdp") == blobs and _steps(svc.url, "fsdp") == [(1, 2)]
    full["model"]["l1.weight"][5, 2] += 1
    with pytest.raises(CheckpointException) as caught:
        _save(svc.url, "fsdp", 1, full, grid=None)
    assert isinstance(_failures(caught)[0], CheckpointExists)
    info = httpx.get(f"{svc.url}/v1/runs/fsdp/checkpoints/1/info").json()
    assert info["checkpoint"]["parts"] == 2


@pytest.mark.postgres
@pytest.mark.s3
def test_two_replicas_on_postgres_and_s3_a_save_retried_through_the_other(
    make_service: Callable[..., Service], backends: dict[str, str]
) -> None:
    """Replica A commits but its answers never arrive (the client is pinned to it); the
    trainer runs the save again through replica B, once as it was and once cut into other
    pieces (read back from S3 to compare): both succeed and nothing more is stored."""
    a, b = make_service(backends), make_service(backends)
    store = s3_store(backends)
    with FaultProxy("127.0.0.1", a.port, http=True) as front:
        front.drop_answers(b"/commit", 2)
        with pytest.raises(CheckpointException):
            _save(front.url, "pinned", 1, _state())
    keys = sorted(store.iter_keys(""))
    _save(b.url, "pinned", 1, _state())
    _save(b.url, "pinned", 1, _state(), grid=None)
    assert sorted(store.iter_keys("")) == keys
    assert _steps(a.url, "pinned") == [(1, 1)]
    other = _state()
    other["half"][0, 0] += 1
    with pytest.raises(CheckpointException) as caught:
        _save(b.url, "pinned", 1, other, grid=None)
    assert "'half@0,0' holds other content" in str(_failures(caught)[0])
    assert_same_state(_state(), CheckpointClient(b.url).load("pinned", 1))


@pytest.mark.postgres
@pytest.mark.s3
def test_two_replicas_on_postgres_and_s3_a_step_saved_again_by_another_world_size(
    make_service: Callable[..., Service], backends: dict[str, str], tmp_path: Path
) -> None:
    """2 FSDP ranks save step 1, each through a replica of its own (64-byte grid); one
    process saves the full state it loads back as step 1 again, cut otherwise, through
    each replica: accepted, no new S3 key; changed: a 409 naming the tensor."""
    a, b = make_service(backends), make_service(backends)
    store = s3_store(backends)
    urls = [a.url, b.url]
    dcp_ranks.launch(dcp_ranks.save_once, 2, urls, "worlds", str(tmp_path), False, 1, 64)
    keys = sorted(store.iter_keys(""))
    full = load_full(b.url, "worlds", 1)
    for url in urls:
        _save(url, "worlds", 1, full, grid=None)
    assert sorted(store.iter_keys("")) == keys
    assert _steps(a.url, "worlds") == [(1, 2)]
    full["model"]["l1.weight"][5, 2] += 1
    with pytest.raises(CheckpointException) as caught:
        _save(a.url, "worlds", 1, full, grid=None)
    (error,) = _failures(caught)
    assert isinstance(error, CheckpointExists) and "'model.l1.weight" in str(error)
    assert_same_state(load_full(a.url, "worlds", 1)["model"], _full_model(tmp_path, "worlds"))


def _full_model(folder: Path, run: str) -> Any:
    """The model state rank 0 gathered when it saved (``dcp_ranks.save_once``)."""
    return torch.load(folder / f"full-{run}.pt", weights_only=True)["model"]
