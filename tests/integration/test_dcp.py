"""torch.distributed.checkpoint through a real service: FSDP2 / HSDP ranks (gloo on CPU)
save with ``CkptStoreWriter``, load with ``CkptStoreReader`` into other world sizes, resume
bit-identically, and one process reads the full state without a process group.

Ranks are forked from the test process (tests/support/dcp_ranks.py); the model is a few
KB, so each test is dominated by process-group start-up.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptstore import CheckpointClient, CheckpointExists, RunNotFound
from ckptstore.dcp import (
    METADATA_KEY,
    CkptStoreReader,
    CkptStoreWriter,
    load_full,
    metadata_from_json,
)
from ckptstore_core.dcp_layout import FULL, LAYOUT_KEY
from support import dcp_ranks
from support.serviceproc import Service
from support.states import assert_same_state, plain_dicts

SAVES = [2, 4, 6]
STEPS = 9  # the uninterrupted run trains on past the last save


def _full(path: Path) -> Any:
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def saved(service: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """4 FSDP2 ranks train 9 steps and save steps 2, 4 and 6 to run ``fsdp``; the folder
    holds full-{step}.pt (the gathered full state at each save) and each rank's losses."""
    out = tmp_path_factory.mktemp("dcp-saved")
    dcp_ranks.launch(dcp_ranks.save_run, 4, service.url, "fsdp", str(out), SAVES, STEPS)
    yield out


def test_four_ranks_commit_each_save_once_with_json_metadata(service: Service, saved: Path) -> None:
    listed = httpx.get(f"{service.url}/v1/runs/fsdp/checkpoints").json()["checkpoints"]
    assert [c["step"] for c in listed] == SAVES
    assert [c["parent_step"] for c in listed] == [None, 2, 4]
    info = httpx.get(f"{service.url}/v1/runs/fsdp/checkpoints/latest/info").json()
    assert info["checkpoint"]["step"] == 6
    assert info["checkpoint"].get("parts", 4) == 4
    metadata = metadata_from_json(info["metadata"][METADATA_KEY])  # JSON, never a pickle
    names = {t["name"] for t in info["tensors"]}
    assert names == {s.name for s in metadata.storage_data.values()}
    # rank 1's rows 4-7 of the 16-row embedding, as pieces of the 2-row grid
    assert {"model.embed.weight@4,0", "model.embed.weight@6,0"} <= names
    assert "model.embed.weight@5,0" not in names
    assert "optim.param_groups.0.lr@bytes" in names
    # the same shards under the same names: the later saves are stored as deltas
    assert all(c["stored_bytes"] < c["raw_bytes"] for c in listed)


@pytest.mark.parametrize("world", [2, 3, 1])
def test_load_into_another_world_size_is_bit_exact(
    service: Service, saved: Path, tmp_path: Path, world: int
) -> None:
    dcp_ranks.launch(dcp_ranks.load_run, world, service.url, "fsdp", str(tmp_path), SAVES, [])
    for step in SAVES:
        assert_same_state(
            _full(saved / f"full-{step}.pt"),
            _full(tmp_path / f"loaded-{world}-{step}.pt"),
            path=f"step {step}",
        )


def test_resume_on_four_ranks_is_bit_identical_and_reads_a_quarter(
    service: Service, saved: Path, tmp_path: Path
) -> None:
    after = list(range(SAVES[-1] + 1, STEPS + 1))
    dcp_ranks.launch(dcp_ranks.load_run, 4, service.url, "fsdp", str(tmp_path), ["latest"], after)
    assert_same_state(_full(saved / "full-6.pt"), _full(tmp_path / "loaded-4-latest.pt"))
    for rank in range(4):
        straight = json.loads((saved / f"losses-{rank}.json").read_text())
        resumed = json.loads((tmp_path / f"resumed-{rank}.json").read_text())
        assert resumed == {str(s): straight[str(s)] for s in after}, f"rank {rank}"
    # each rank fetched its own shards plus the replicated items (scalars, bytes), and the
    # shards of the four ranks plus one copy of the replicated items are the checkpoint
    fetched = [
        json.loads((tmp_path / f"fetched-4-{rank}.json").read_text())["latest"] for rank in range(4)
    ]
    replicated = {got - own for got, own in fetched}
    assert len(replicated) == 1
    raw = CheckpointClient(service.url).list("fsdp")[-1].raw_bytes
    assert sum(own for _, own in fetched) + replicated.pop() == raw


def test_one_process_loads_the_full_state(service: Service, saved: Path) -> None:
    with CheckpointClient(service.url) as client:
        for step in SAVES:
            expected = plain_dicts(_full(saved / f"full-{step}.pt"))
            assert_same_state(expected, client.load("fsdp", step), path=f"step {step}")
        model_only = client.load("fsdp", 4, prefix="model.")
    assert list(model_only) == ["model"]
    assert_same_state(plain_dicts(_full(saved / "full-4.pt"))["model"], model_only["model"])
    assert_same_state(plain_dicts(_full(saved / "full-6.pt")), load_full(service.url, "fsdp"))


def test_a_plain_get_is_the_full_state_as_one_safetensors_file(
    service: Service, saved: Path
) -> None:
    from safetensors.torch import load as load_safetensors
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    response = httpx.get(f"{service.url}/v1/runs/fsdp/checkpoints/latest", timeout=60)
    assert response.status_code == 200 and response.headers["x-ckptstore-step"] == "6"
    body = response.content
    header = json.loads(body[8 : 8 + int.from_bytes(body[:8], "little")])
    assert header["__metadata__"][LAYOUT_KEY] == FULL
    served = load_safetensors(body)  # the safetensors library reads it
    flat, _ = flatten_state_dict(_full(saved / "full-6.pt"))
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    assert set(tensors) <= set(served)  # DCP's names, not pieces: "model.embed.weight"
    for name, tensor in tensors.items():
        assert served[name].dtype == tensor.dtype and torch.equal(served[name], tensor), name
    # the rest are DCP's torch.save bytes of the non-tensor values, as U8 tensors
    others = set(served) - set(tensors)
    assert others and all(served[name].dtype == torch.uint8 for name in others)
    only_model = httpx.get(
        f"{service.url}/v1/runs/fsdp/checkpoints/6", params={"prefix": "model."}, timeout=60
    )
    assert set(load_safetensors(only_model.content)) == {
        k for k in tensors if k.startswith("model.")
    }


def test_a_committed_step_is_not_written_again(service: Service, saved: Path) -> None:
    state = {"w": torch.ones(3)}
    with pytest.raises(CheckpointException) as caught:
        dcp.save(state, storage_writer=CkptStoreWriter(service.url, "fsdp", 2), no_dist=True)
    assert [type(e) for e, _ in caught.value.failures.values()] == [CheckpointExists]
    assert [c.step for c in CheckpointClient(service.url).list("fsdp")] == SAVES


def test_a_rank_failing_mid_upload_leaves_nothing_and_the_save_is_retried(
    make_service: Any, tmp_path: Path
) -> None:
    service = make_service()
    dcp_ranks.launch(dcp_ranks.failing_save, 2, service.url, "fails", str(tmp_path))
    for rank in range(2):  # DCP reports the one rank's failure on every rank
        assert "this rank fails mid-upload" in (tmp_path / f"failed-{rank}.txt").read_text()
    # nothing of step 2 was visible after the failure: latest was still step 1
    assert json.loads((tmp_path / "latest-after-failure.json").read_text()) == "fails/1"
    with CheckpointClient(service.url) as client:
        assert [c.step for c in client.list("fails")] == [1, 2]
        assert_same_state(plain_dicts(_full(tmp_path / "full-2.pt")), client.load("fails", 2))


def test_a_resharded_save_keeps_the_names_of_whole_grid_cells(
    make_service: Any, tmp_path: Path
) -> None:
    """4 ranks save step 1; 2 ranks load it and save step 2. The 16-row weights (embedding,
    l2) have grids of 2 and 1 rows, which both worlds' shards (4, 8 rows) cover in whole cells:
    step 2 stores them under step 1's names and shapes, and the service diffs them as it
    would a save of the same world size. The 12-row l1.weight is cut in 3-row shards by 4
    ranks, not at its grid: only its whole cells keep their names."""
    service = make_service()
    grid = dcp_ranks.GRID
    dcp_ranks.launch(dcp_ranks.save_once, 4, service.url, "grid", str(tmp_path), False, 1, grid)
    dcp_ranks.launch(dcp_ranks.resharded_save, 2, service.url, "grid", grid)

    def tensors(step: int) -> dict[str, list[int]]:
        info = httpx.get(f"{service.url}/v1/runs/grid/checkpoints/{step}/info").json()
        return {t["name"]: t["shape"] for t in info["tensors"]}

    before, after = tensors(1), tensors(2)
    aligned = {
        n: s for n, s in after.items() if len(s) == 2 and ("embed.weight" in n or "l2.w" in n)
    }
    assert len(aligned) == 3 * (8 + 16)  # param, exp_avg, exp_avg_sq of 8 and 16 cells
    assert aligned.items() <= before.items()
    assert after["model.l1.weight@0,0"] == before["model.l1.weight@0,0"] == [2, 8]
    assert after["model.l1.weight@2,0"] == [2, 8] and before["model.l1.weight@2,0"] == [1, 8]
    listed = CheckpointClient(service.url).list("grid")
    assert [c.parent_step for c in listed] == [None, 1]
    assert listed[1].stored_bytes < listed[1].raw_bytes


def test_hsdp_stores_one_replica(make_service: Any, tmp_path: Path) -> None:
    """HSDP on a 2x2 mesh (replicate x shard) stores the bytes a 2-rank FSDP save of the
    same state stores: DCP's dedup writes each replicated shard once. (Untrained, so both
    hold the same values: HSDP trained on 4 ranks' batches would not.)"""
    service = make_service()
    dcp_ranks.launch(dcp_ranks.save_once, 4, service.url, "hsdp", str(tmp_path), True, 0)
    dcp_ranks.launch(dcp_ranks.save_once, 2, service.url, "fsdp2", str(tmp_path), False, 0)
    with CheckpointClient(service.url) as client:
        hsdp, fsdp = client.list("hsdp")[0], client.list("fsdp2")[0]
        assert (hsdp.raw_bytes, hsdp.tensors) == (fsdp.raw_bytes, fsdp.tensors)
        assert hsdp.stored_bytes == fsdp.stored_bytes
        full = plain_dicts(_full(tmp_path / "full-hsdp.pt"))
        assert_same_state(full, client.load("hsdp", 1))
    names = {
        t["name"]: t["shape"]
        for t in httpx.get(f"{service.url}/v1/runs/hsdp/checkpoints/1/info").json()["tensors"]
    }
    assert names["model.embed.weight@0,0"] == [8, 8]  # sharded 2-way, not 4-way
    assert "model.embed.weight@4,0" not in names


# the process executor spawns a checkpoint process per rank, which imports torch afresh:
# 25-60 s on the shared 2-core host
@pytest.mark.parametrize(
    ("executor", "async_staging"),
    [
        ("thread", False),
        ("thread", True),  # the copy overlaps the next forward/backward
        pytest.param("process", False, marks=pytest.mark.slow),
    ],
)
def test_async_save_lands_loadable_checkpoints(
    make_service: Any, tmp_path: Path, executor: str, async_staging: bool
) -> None:
    service = make_service()
    run = f"async-{executor}-{'overlap' if async_staging else 'copy'}"
    dcp_ranks.launch(
        dcp_ranks.async_run, 2, service.url, run, str(tmp_path), executor, async_staging
    )
    with CheckpointClient(service.url) as client:
        assert [c.step for c in client.list(run)] == [1, 2]
        for step in (1, 2):
            expected = plain_dicts(_full(tmp_path / f"full-{step}.pt"))
            assert_same_state(expected, client.load(run, step), path=f"step {step}")
    stalls = json.loads((tmp_path / "stalls.json").read_text())
    print(f"dcp.async_save ({executor} executor) returned after {stalls} s")


@pytest.mark.timeout(240)
def test_async_save_on_the_default_group_is_refused_at_once(
    make_service: Any, tmp_path: Path
) -> None:
    """dcp.async_save on the default process group while training's collectives run on it:
    the two threads' collectives interleave on one group, which hung (or aborted) the ranks.
    The writer refuses it in async_save itself, naming the group to pass; no checkpoint."""
    service = make_service()
    dcp_ranks.launch(
        dcp_ranks.async_beside_training, 2, service.url, "shared-group", str(tmp_path), False
    )
    for rank in (0, 1):
        message = (tmp_path / f"refused-{rank}.txt").read_text()
        assert 'process_group=dist.new_group(backend="gloo")' in message
    with CheckpointClient(service.url) as client, pytest.raises(RunNotFound):
        client.list("shared-group")


@pytest.mark.timeout(240)
def test_async_save_on_its_own_group_runs_beside_training(
    make_service: Any, tmp_path: Path
) -> None:
    """The same with process_group=dist.new_group(backend="gloo"): training steps run
    while the upload does, and the checkpoint is the state at the call, bit for bit."""
    service = make_service()
    dcp_ranks.launch(
        dcp_ranks.async_beside_training, 2, service.url, "own-group", str(tmp_path), True
    )
    trained = [json.loads((tmp_path / f"trained-{rank}.json").read_text()) for rank in (0, 1)]
    assert trained[0] == trained[1] >= 1
    with CheckpointClient(service.url) as client:
        expected = plain_dicts(_full(tmp_path / "full-1.pt"))
        assert_same_state(expected, client.load("own-group", 1))


def test_one_process_without_a_process_group(service: Service) -> None:
    """dcp.save / dcp.load with no_dist: plain tensors cut at a 32-byte grid (pieces of
    tensors that are not shards), a bf16 one, a scalar, non-tensor values."""
    torch.manual_seed(0)
    state = {
        "w": torch.randn(12, 4),
        "half": torch.randn(6, 3).to(torch.bfloat16),
        "count": torch.tensor(3),
        "config": {"lr": 0.1, "names": ["a", "b"]},
    }
    writer = CkptStoreWriter(service.url, "one-process", 1, grid_bytes=32)
    dcp.save(state, storage_writer=writer, no_dist=True)
    target = {
        "w": torch.zeros(12, 4),
        "half": torch.zeros(6, 3, dtype=torch.bfloat16),
        "count": torch.tensor(0),
        "config": {"lr": 0.0, "names": []},
    }
    dcp.load(target, storage_reader=CkptStoreReader(service.url, "one-process"), no_dist=True)
    assert_same_state(state, target, same_objects=False)
    info = httpx.get(f"{service.url}/v1/runs/one-process/checkpoints/1/info").json()
    assert [t["name"] for t in info["tensors"] if t["name"].startswith("w@")] == [
        f"w@{row},0" for row in range(0, 12, 2)
    ]
    assert_same_state(state, CheckpointClient(service.url).load("one-process", 1))


def test_plain_checkpoints_still_load_flat(service: Service) -> None:
    with CheckpointClient(service.url) as client:
        state = OrderedDict(w=torch.arange(4.0))
        client.save("plain", 1, state)
        assert_same_state(state, client.load("plain", 1))


@pytest.mark.postgres
@pytest.mark.s3
def test_ranks_spread_over_two_replicas_on_postgres_and_s3(
    make_service: Any, backends: dict[str, str], tmp_path: Path
) -> None:
    """4 ranks save two steps through two replicas sharing PostgreSQL and S3 (ranks
    alternate between them, the commit goes through the first); 3 ranks load both, spread
    over the replicas too; one process loads the full state through the other replica."""
    urls = [make_service(backends).url, make_service(backends).url]
    dcp_ranks.launch(dcp_ranks.save_run, 4, urls, "prod", str(tmp_path), [1, 2], 2)
    dcp_ranks.launch(dcp_ranks.load_run, 3, urls, "prod", str(tmp_path), [1, 2], [])
    with CheckpointClient(urls[1]) as client:
        assert [(c.step, c.parts) for c in client.list("prod")] == [(1, 4), (2, 4)]
        for step in (1, 2):
            full = _full(tmp_path / f"full-{step}.pt")
            assert_same_state(full, _full(tmp_path / f"loaded-3-{step}.pt"), path=f"{step}")
            assert_same_state(plain_dicts(full), client.load("prod", step), path=f"{step}")


def test_async_save_stages_into_reused_buffers(make_service: Any, tmp_path: Path) -> None:
    """The writer stages dcp.async_save's state itself: each checkpoint is the state at
    the call bit for bit, although the trainer changed it in place right after the call
    returned; the second save copied into the first one's buffers on every rank."""
    service = make_service()
    dcp_ranks.launch(dcp_ranks.staged_run, 2, service.url, "staged", str(tmp_path))
    with CheckpointClient(service.url) as client:
        assert [c.step for c in client.list("staged")] == [1, 2]
        for step in (1, 2):
            expected = plain_dicts(_full(tmp_path / f"full-{step}.pt"))
            assert_same_state(expected, client.load("staged", step), path=f"step {step}")
    for rank in (0, 1):
        assert json.loads((tmp_path / f"reused-{rank}.json").read_text()) is True
