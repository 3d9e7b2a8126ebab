"""A save whose commit landed but whose answer was lost (issue 32), on SQLite and PostgreSQL.

The window is reproduced with :meth:`FaultProxy.drop_answers`: the commit (or a plain save's
POST) goes through whole, the service commits, and the connection is reset as its answer
begins. The client asks again; a save reported failed all the same (every answer lost) is
retried whole by the trainer, under a new save token, maybe by another world size: the same
content is accepted without being stored again, other content is a 409 that says so. A rank
learns either before it sends its part's body (``POST .../parts/{part}/check``): the tests
count the requests a :class:`Requests` proxy forwards, and no part body goes to a committed
step.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
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
from ckptstore.parts import tensor_checksums
from ckptstore_core.wire import FORMAT, encode_header
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


class Requests:
    """The request lines a FaultProxy forwards (``check`` sees each request's head)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, head: bytes) -> None:
        with self._lock:
            self.lines.append(head.split(b"\r\n", 1)[0].decode())

    def take(self) -> Counter[str]:
        """What went through since the last take: part ``checks``, part ``bodies`` (PUTs),
        ``commits``, and ``other`` requests."""
        with self._lock:
            lines, self.lines = self.lines, []
        out: Counter[str] = Counter()
        for line in lines:
            method, path = line.split(" ")[:2]
            if "/parts/" in path and path.endswith("/check"):
                out["checks"] += 1
            elif "/parts/" in path and method == "PUT":
                out["bodies"] += 1
            else:
                out["commits" if path.endswith("/commit") else "other"] += 1
        return out


@pytest.fixture
def counted(svc: Service) -> Iterator[tuple[FaultProxy, Requests]]:
    """A proxy in front of ``svc`` and the requests it forwarded."""
    seen = Requests()
    with FaultProxy("127.0.0.1", svc.port, http=True, check=seen) as p:
        yield p, seen


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
    svc: Service, counted: tuple[FaultProxy, Requests], tmp_path: Path
) -> None:
    """2 FSDP ranks save step 1 (64-byte grid); one process saves the full state it loads
    back as step 1 again, cut otherwise: accepted with no part body sent (its pieces are
    regions of the stored ones, hashed by the service), nothing stored; changed: a 409."""
    proxy, seen = counted
    dcp_ranks.launch(dcp_ranks.save_once, 2, svc.url, "fsdp", str(tmp_path), False, 1, 64)
    blobs = _blobs(svc, "fsdp")
    full = load_full(svc.url, "fsdp", 1)
    _save(proxy.url, "fsdp", 1, full, grid=None)
    assert seen.take() == {"checks": 2, "commits": 1}
    assert _blobs(svc, "fsdp") == blobs and _steps(svc.url, "fsdp") == [(1, 2)]
    full["model"]["l1.weight"][5, 2] += 1
    with pytest.raises(CheckpointException) as caught:
        _save(proxy.url, "fsdp", 1, full, grid=None)
    assert isinstance(_failures(caught)[0], CheckpointExists)
    assert "'model.l1.weight" in str(_failures(caught)[0])
    assert seen.take() == {"checks": 2}
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


def test_a_committed_step_saved_again_sends_no_part_body(
    svc: Service, counted: tuple[FaultProxy, Requests]
) -> None:
    """An uncommitted step: each part asks once (its header) and is uploaded. The same step
    saved again, under other part names and cut into other pieces: each part asks twice
    (header, then checksums) and sends no body; the commit is a 200. Other bytes, or another
    tensor: a 409 naming it, no body sent."""
    proxy, seen = counted
    _save(proxy.url, "counted", 1, _state())
    assert seen.take() == {"checks": 1, "bodies": 1, "commits": 1}  # as today, and one question
    blobs = _blobs(svc, "counted")
    for grid in (32, None):
        _save(proxy.url, "counted", 1, _state(), grid=grid)
        assert seen.take() == {"checks": 2, "commits": 1}  # the header, then the checksums
    assert _blobs(svc, "counted") == blobs and _steps(svc.url, "counted") == [(1, 1)]

    other = _state()
    other["half"][4, 2] += 1
    with pytest.raises(CheckpointException) as caught:
        _save(proxy.url, "counted", 1, other, grid=None)
    assert "'half@0,0' holds other content" in str(_failures(caught)[0])
    other = _state()
    other["extra"] = torch.ones(2)
    with pytest.raises(CheckpointException) as caught:
        _save(proxy.url, "counted", 1, other)
    assert "'extra@0'" in str(_failures(caught)[0])
    assert seen.take() == {"checks": 3}  # header and checksums; the header alone (409)
    assert_same_state(_state(), CheckpointClient(svc.url).load("counted", 1))


def test_a_part_checked_before_its_body(svc: Service) -> None:
    """Raw HTTP: ``POST .../parts/{part}/check`` of a step not committed, then committed
    from 2 ranks and checked as 4 ranks' parts (regions of the stored pieces, read back and
    hashed by the service): the same, another region, other bytes; and bad checksums."""

    def check(step: int, part: str, tensors: dict[str, Any], sums: bool = True) -> httpx.Response:
        prefix, header = encode_header(
            [(name, "F32", a.shape) for name, a in tensors.items()], {"format": FORMAT}
        )
        doc: dict[str, Any] = {"header": prefix[8:].decode()}
        if sums:
            doc["checksums"] = tensor_checksums(header, [a.tobytes() for a in tensors.values()])
        path = f"/v1/runs/ask/checkpoints/{step}/parts/{part}/check"
        return httpx.post(svc.url + path, json=doc, timeout=60)

    first = check(1, "rank-0", shards(1, 2)[0], sums=False)
    assert first.status_code == 200 and first.json()["committed"] is False, first.text
    save_in_parts(svc.url, "ask", 1)
    assert check(1, "rank-0.b", shards(1, 2)[0]).json()["committed"] is False  # not yet
    assert commit(svc.url, "ask", 1, ["rank-0", "rank-1"], {"dcp": dcp_layout()}).status_code == 201
    blobs = _blobs(svc, "ask")

    header_only = check(1, "rank-3.b", shards(1, 4)[3], sums=False)
    assert header_only.json() == {"committed": True, "same": None, "part": None}
    same = check(1, "rank-3.b", shards(1, 4)[3])
    assert same.status_code == 200, same.text
    assert same.json()["same"] is True
    assert same.json()["part"] == {
        "run": "ask",
        "step": 1,
        "part": "rank-3.b",
        "tensors": 2,
        "raw_bytes": 16 * 512 * 4 + 16 * 4,
        "stored_bytes": 0,
        "committed": True,
    }
    w = shards(1, 1)[0]["w@0,0"]
    assert check(1, "c", {"w@0,8": w[:, 8:16]}).json()["same"] is True  # not whole rows
    shifted = check(1, "c", {"w@0,8": w[:, :8]})
    assert_error(shifted, 409, "checkpoint_exists")
    assert "'w@0,8' holds other content" in shifted.json()["error"]["message"]
    changed = check(1, "rank-1.x", shards(2, 2)[0])
    assert_error(changed, 409, "checkpoint_exists")
    assert "'w@0,0' holds other content" in changed.json()["error"]["message"]
    assert _blobs(svc, "ask") == blobs

    prefix, _ = encode_header([("b@0", "F32", (64,))], {"format": FORMAT})
    path = f"{svc.url}/v1/runs/ask/checkpoints/1/parts/p/check"
    header = prefix[8:].decode()
    for sums in ({}, {"b@0": "zz" * 16}, {"b@0": "00" * 16, "other": "00" * 16}):
        bad = httpx.post(path, json={"header": header, "checksums": sums})
        assert_error(bad, 400, "invalid_request")
    not_json = httpx.post(path, json={"header": json.dumps({"b": 1})})
    assert not_json.status_code == 400, not_json.text


def _full_model(folder: Path, run: str) -> Any:
    """The model state rank 0 gathered when it saved (``dcp_ranks.save_once``)."""
    return torch.load(folder / f"full-{run}.pt", weights_only=True)["model"]


def test_a_service_without_the_check_route_gets_the_part_uploaded(
    svc: Service, counted: tuple[FaultProxy, Requests]
) -> None:
    """A service older than ``.../check`` (a rolling upgrade) answers it a plain 404, not
    an error of the tree: the rank uploads its part as before and the save lands."""
    proxy, seen = counted
    proxy.answer(b"/check ", 10, "404 Not Found", b'{"detail":"Not Found"}')
    _save(proxy.url, "older", 1, _state())
    assert proxy.answered == 1
    assert seen.take() == {"bodies": 1, "commits": 1}  # the answered check is not forwarded
    assert_same_state(_state(), CheckpointClient(svc.url).load("older", 1))
