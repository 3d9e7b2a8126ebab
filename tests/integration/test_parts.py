"""Checkpoints written in parts by several writers and committed once, against a real
service over raw HTTP (SQLite + local folder; tests/integration/test_dcp.py drives them
through torch.distributed.checkpoint, and PostgreSQL + S3 replicas)."""

from __future__ import annotations

import os
from collections.abc import Callable

import httpx
import numpy as np
import pytest

from support.bodies import assert_error
from support.parts import commit, dcp_layout, part_body, put_part, save_in_parts, shards, tensors_of
from support.serviceproc import Service, wait_idle
from support.waiting import wait_until


def test_parts_are_invisible_until_the_commit_then_load_as_one_checkpoint(
    make_service: Callable[..., Service],
) -> None:
    svc = make_service()
    save_in_parts(svc.url, "dist", 1)
    with httpx.Client(base_url=svc.url, timeout=60) as c:
        assert c.get("/v1/runs/dist/checkpoints").status_code == 404  # nothing visible
        assert c.get("/v1/runs/dist/checkpoints/latest").status_code == 404
    done = commit(svc.url, "dist", 1, ["rank-0", "rank-1"], {"dcp": dcp_layout()})
    assert done.status_code == 201, done.text
    assert done.json()["parts"] == 2 and done.json()["step"] == 1
    with httpx.Client(base_url=svc.url, timeout=60) as c:
        listed = c.get("/v1/runs/dist/checkpoints").json()["checkpoints"]
        assert [(ck["step"], ck["parts"]) for ck in listed] == [(1, 2)]
        whole = c.get("/v1/runs/dist/checkpoints/1")
        assert whole.status_code == 200
        info = c.get("/v1/runs/dist/checkpoints/latest/info").json()
        picked = c.post("/v1/runs/dist/checkpoints/1/select", json={"names": ["w@32,0"]})
    expected = {k: v.tobytes() for part in shards(1) for k, v in part.items()}
    # a plain GET serves the full tensors that the DCP layout describes, in its order
    full = {n: b"".join(expected[p] for p in expected if p.startswith(f"{n}@")) for n in "wb"}
    assert tensors_of(whole.content) == full
    assert [t["name"] for t in info["tensors"]] == list(expected)
    assert info["metadata"]["dcp"] == dcp_layout() and info["checkpoint"]["parts"] == 2
    assert tensors_of(picked.content) == {"w@32,0": expected["w@32,0"]}
    assert int(picked.headers["content-length"]) < 0.6 * len(whole.content)  # half the rows


def test_the_next_save_of_the_same_shards_pays_deltas(make_service: Callable[..., Service]):
    svc = make_service()
    for step in (1, 2):
        save_in_parts(svc.url, "deltas", step)
        assert commit(svc.url, "deltas", step, ["rank-0", "rank-1"]).status_code == 201
    with httpx.Client(base_url=svc.url, timeout=60) as c:
        first, second = c.get("/v1/runs/deltas/checkpoints").json()["checkpoints"]
        back = c.get("/v1/runs/deltas/checkpoints/2")
    assert second["parent_step"] == 1 and second["chain_depth"] >= 1 and first["keyframe"]
    assert second["stored_bytes"] < first["stored_bytes"] / 2
    expected = {k: v.tobytes() for part in shards(2) for k, v in part.items()}
    assert tensors_of(back.content) == expected


def test_retries_conflicts_and_bad_commits(make_service: Callable[..., Service]) -> None:
    svc = make_service()
    bodies = save_in_parts(svc.url, "retry", 5)
    again = put_part(svc.url, "retry", 5, "rank-0", part_body(bodies[0]))
    assert again.status_code == 200, again.text  # same content: idempotent
    other = put_part(svc.url, "retry", 5, "rank-0", part_body(bodies[1]))
    assert_error(other, 409, "checkpoint_exists")
    assert_error(commit(svc.url, "retry", 5, ["rank-0", "rank-7"]), 400, "invalid_request")
    for layout in ("{}", "not json", dcp_layout(ranks=4)):  # no DCP layout of these parts
        bad = commit(svc.url, "retry", 5, ["rank-0", "rank-1"], {"dcp": layout})
        assert_error(bad, 400, "invalid_request")
        assert "no DCP layout" in bad.json()["error"]["message"]
    assert_error(commit(svc.url, "retry", 6, ["rank-0"]), 400, "invalid_request")
    assert_error(put_part(svc.url, "retry", 5, "-x", b""), 400, "invalid_request")
    assert commit(svc.url, "retry", 5, ["rank-0", "rank-1"]).status_code == 201
    assert commit(svc.url, "retry", 5, ["rank-0", "rank-1"]).status_code == 200  # a retry
    assert_error(commit(svc.url, "retry", 5, ["rank-0"]), 409, "checkpoint_exists")
    late = put_part(svc.url, "retry", 5, "rank-2", part_body(bodies[0]))
    assert late.status_code == 200, late.text  # rank-0's tensors again: the same content
    other = put_part(svc.url, "retry", 5, "rank-2", part_body(shards(6)[0]))
    assert_error(other, 409, "checkpoint_exists")


def test_parts_of_any_sizes_number_on(
    make_service: Callable[..., Service], database_url: str
) -> None:
    """Parts holding more tensors than the ones before them (the unique index on tensor
    numbers must not trip while a part's are shifted), on SQLite and PostgreSQL."""
    svc = make_service({"CKPTSTORE_DATABASE_URL": database_url})
    rng = np.random.default_rng(3)
    sizes = [1, 3, 2, 5]
    parts = [
        {f"p{p}.t{i}": rng.standard_normal((7, 3)).astype(np.float32) for i in range(n)}
        for p, n in enumerate(sizes)
    ]
    for p, tensors in enumerate(parts):
        assert put_part(svc.url, "sizes", 1, f"rank-{p}", part_body(tensors)).status_code == 201
    done = commit(svc.url, "sizes", 1, [f"rank-{p}" for p in range(len(parts))])
    assert done.status_code == 201, done.text
    assert done.json()["tensors"] == sum(sizes)
    with httpx.Client(base_url=svc.url, timeout=60) as c:
        back = c.get("/v1/runs/sizes/checkpoints/1")
    assert back.status_code == 200
    assert tensors_of(back.content) == {k: v.tobytes() for t in parts for k, v in t.items()}


def test_clashing_names_and_unnamed_parts(make_service: Callable[..., Service]) -> None:
    svc = make_service()
    bodies = shards(3)
    for part, body in (("a", bodies[0]), ("b", bodies[0]), ("c", bodies[1])):
        assert put_part(svc.url, "clash", 3, part, part_body(body)).status_code == 201
    assert_error(commit(svc.url, "clash", 3, ["a", "b"]), 400, "invalid_request")
    blobs = svc.data_dir / "blobs" / "runs" / "clash"
    assert len(os.listdir(blobs)) == 3
    assert commit(svc.url, "clash", 3, ["a", "c"]).status_code == 201
    assert len(os.listdir(blobs)) == 2  # part b, named by no commit, is gone


def test_parts_survive_the_re_root_pass(make_service: Callable[..., Service]) -> None:
    """A run saved in parts whose chain gets deep enough to re-root: the re-root (one new
    blob per checkpoint) leaves checkpoints written in parts alone, and every one still
    loads exactly (it once rewrote them into a blob their chunks were not read from)."""
    env = {
        "CKPTSTORE_REROOT_DEPTH": "4",
        "CKPTSTORE_REROOT_QUIET_S": "0",
        "CKPTSTORE_KEYFRAME_INTERVAL": "100",
        "CKPTSTORE_MAX_CHAIN_DEPTH": "100",
    }
    svc = make_service(env)
    for step in range(8):
        save_in_parts(svc.url, "deep", step)
        assert commit(svc.url, "deep", step, ["rank-0", "rank-1"]).status_code == 201
        wait_idle(svc.url)
    with httpx.Client(base_url=svc.url, timeout=60) as c:
        listed = c.get("/v1/runs/deep/checkpoints").json()["checkpoints"]
        assert max(ck["chain_depth"] for ck in listed) >= 4  # deep enough to be due
        for step in range(8):
            back = c.get(f"/v1/runs/deep/checkpoints/{step}")
            assert back.status_code == 200, (step, back.text)
            expected = {k: v.tobytes() for part in shards(step) for k, v in part.items()}
            assert tensors_of(back.content) == expected, step


def test_parts_never_committed_are_collected(make_service: Callable[..., Service]) -> None:
    svc = make_service({"CKPTSTORE_PARTS_TTL_S": "1"})
    save_in_parts(svc.url, "gone", 1)
    blobs = svc.data_dir / "blobs" / "runs" / "gone"
    assert len(os.listdir(blobs)) == 2
    svc.stop()
    svc.start()  # the start-up sweep collects what is older than the TTL
    wait_until(lambda: not os.listdir(blobs), timeout=30)
    save_in_parts(svc.url, "gone", 1)  # and the step can be saved afresh
    assert commit(svc.url, "gone", 1, ["rank-0", "rank-1"]).status_code == 201


@pytest.mark.parametrize("where", ["header", "data"])
def test_a_part_cut_short_leaves_nothing(make_service: Callable[..., Service], where: str):
    svc = make_service()
    body = part_body(shards(1)[0])
    cut = body[:10] if where == "header" else body[: len(body) - 100]
    assert_error(put_part(svc.url, "cut", 1, "rank-0", cut), 400, "invalid_stream")
    blobs = svc.data_dir / "blobs" / "runs" / "cut"
    wait_until(lambda: not blobs.is_dir() or not os.listdir(blobs), timeout=30)
    assert put_part(svc.url, "cut", 1, "rank-0", body).status_code == 201
