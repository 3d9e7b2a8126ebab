"""Lossy saves through the service (issue 23, docs/lossy.md): a tiny real model trained with
AdamW for a few steps, saved over HTTP with ``lossy=``, against a real service.

What must hold: a lossy checkpoint loads to the same bytes every time (twice from the
service, and again cold after a restart with the base cache emptied); everything but the
paired fp32 weights and their Adam moments comes back bit-exact; the paired tensors differ
from what was saved, within a tolerance; a chain that mixes lossless and lossy saves
rebuilds every checkpoint, and the save after a lossy one diffs against what it loads to;
listings say which checkpoints are lossy and with what; a retried lossy save is an
idempotent 200; bad parameters are a 400 that stores nothing; a corrupt lossy payload is
CorruptData, never wrong bytes; both state layouts (integer ids, FQN keys) pair their
weights with their moments, and a state without an optimizer prunes its weights alone.
"""

from __future__ import annotations

import copy
import json
import shutil
import sqlite3
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch
from torch import nn

from ckptstore import CheckpointClient, CheckpointExists, CorruptData, InvalidRequest, Lossy
from ckptstore_core.errors import CkptStoreError
from ckptstore_core.records import LOSSY_KEY
from ckptstore_core.wire import FORMAT, encode_header
from support.bodies import assert_error, assert_nothing_stored, client_body, post, stored_data
from support.serviceproc import Service, forget_cache, wait_idle
from support.states import assert_same_state

# 64 KiB chunks: the first layer's weight (32768 fp32) spans two, its bias stays under
# lossy.MIN_ELEMENTS (lossless)
ENV = {"CKPTSTORE_CHUNK_BYTES": str(64 << 10)}
DEFAULTS = Lossy().to_json()
PAIRED = ("model/0.weight", "model/3.weight")  # the Linear weights (>= MIN_ELEMENTS each)


class Trainer:
    """A tiny model (Linear, BatchNorm, Linear) trained with AdamW and a scheduler; each
    :meth:`state` is a deep copy (the live state dicts alias the parameters)."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(
            nn.Linear(64, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 64)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=5)
        self.gen = torch.Generator().manual_seed(seed)
        self.steps = 0

    def train(self, n: int = 3) -> None:
        for _ in range(n):
            x = torch.randn(32, 64, generator=self.gen)
            loss = (self.model(x) - x).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.steps += 1

    def state(self) -> dict[str, Any]:
        return copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(),
                "rng": torch.get_rng_state(),
                "step": self.steps,
                "extra": {
                    "ids": torch.arange(5000, dtype=torch.int64) * self.steps,
                    "half": self.model[3].weight.detach().to(torch.bfloat16),
                },
            }
        )

    def fqn_state(self) -> dict[str, Any]:
        """The layout of ``torch.distributed.checkpoint.state_dict``: moments keyed by the
        parameters' names, not by integer ids."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        opt = self.opt.state_dict()
        params = list(self.model.parameters())
        state = {names[id(params[i])]: s for i, s in opt["state"].items()}
        groups = [
            {**g, "params": [names[id(params[i])] for i in g["params"]]}
            for g in opt["param_groups"]
        ]
        return copy.deepcopy(
            {"model": self.model.state_dict(), "optim": {"state": state, "param_groups": groups}}
        )


def _db(svc: Service) -> sqlite3.Connection:
    return sqlite3.connect(svc.data_dir / "catalog.sqlite3")


def lossy_tensors(svc: Service, run: str, step: int) -> set[str]:
    """The names of the tensors of ``run/step`` that hold a chunk stored lossy."""
    with _db(svc) as db:
        rows = db.execute(
            "SELECT DISTINCT t.name FROM chunks c JOIN checkpoints k ON k.id = c.checkpoint_id "
            "JOIN runs r ON r.id = k.run_id JOIN tensors t ON t.checkpoint_id = k.id "
            "AND t.idx = c.tensor_idx WHERE r.name = ? AND k.step = ? AND k.status = 'committed' "
            "AND c.codec = 'lossy/1'",
            (run, step),
        ).fetchall()
    return {name for (name,) in rows}


def _moments(state: dict[str, Any], key: str) -> list[torch.Tensor]:
    return [s[key] for s in state["optimizer"]["state"].values()]


def check_lossy(saved: dict[str, Any], loaded: dict[str, Any]) -> None:
    """``loaded`` is ``saved`` bit for bit but for the paired weights and moments, which
    differ from it within a tolerance."""
    exact = copy.copy(loaded)
    exact["model"] = copy.copy(loaded["model"])  # an OrderedDict, with its _metadata
    for name in PAIRED:
        exact["model"][name[6:]] = saved["model"][name[6:]]
    opt = copy.deepcopy(loaded["optimizer"])
    for i, s in opt["state"].items():
        s["exp_avg"] = saved["optimizer"]["state"][i]["exp_avg"]
        s["exp_avg_sq"] = saved["optimizer"]["state"][i]["exp_avg_sq"]
    exact["optimizer"] = opt
    assert_same_state(saved, exact, same_objects=False)  # the rest: every byte
    for name in PAIRED:
        w, r = saved["model"][name[6:]], loaded["model"][name[6:]]
        assert not torch.equal(w, r), name  # lossy indeed
        # AdamW moves an element by about lr (1e-3) per step: what pruning leaves out
        assert (r - w).abs().max() <= 0.02 and (r - w).norm() <= 0.05 * w.norm(), name
    for key in ("exp_avg", "exp_avg_sq"):
        for m, r in zip(_moments(saved, key), _moments(loaded, key), strict=True):
            assert r.dtype == m.dtype and r.shape == m.shape
            assert (r - m).norm() <= m.norm(), key
            if key == "exp_avg_sq":
                assert (r >= 0).all()


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run saved as exact, lossy, lossy, exact, lossy (defaults), lossy (weights only, exact
    moments), and the same states saved exact in another run; the service keeps running."""
    svc = Service(tmp_path_factory.mktemp("lossy"), ENV).start()
    client = CheckpointClient(svc.url)
    trainer = Trainer()
    asked: list[bool | Lossy] = [False, True, True, False, Lossy(), Lossy(exact_moments=True)]
    states = []
    for step, lossy in enumerate(asked):
        trainer.train()
        states.append(trainer.state())
        client.save("run", step, states[-1], lossy=lossy)
        client.save("exact", step, states[-1])
    yield {"svc": svc, "client": client, "states": states, "asked": asked}
    client.close()
    svc.stop()


def test_listing_says_which_checkpoints_are_lossy(chain: dict[str, Any]) -> None:
    client: CheckpointClient = chain["client"]
    infos = client.list("run")
    expected = [None, DEFAULTS, DEFAULTS, None, DEFAULTS, Lossy(exact_moments=True).to_json()]
    assert [i.lossy for i in infos] == expected
    assert all(i.lossy is None for i in client.list("exact"))
    # the same through the HTTP API and the CLI's JSON
    listed = chain["svc"].url + "/v1/runs/run/checkpoints"
    assert [c["lossy"] for c in httpx.get(listed).json()["checkpoints"]] == expected
    # lossy chunks go on through keyframes, so a lossy checkpoint is never listed as one
    assert not any(i.keyframe for i in infos[1:3])
    # and they are much smaller than the same states' lossless deltas
    exact = client.list("exact")
    for step in (1, 2, 4):
        assert infos[step].stored_bytes < 0.5 * exact[step].stored_bytes, step


def test_paired_tensors_are_lossy_and_the_rest_exact(chain: dict[str, Any]) -> None:
    client: CheckpointClient = chain["client"]
    svc: Service = chain["svc"]
    states = chain["states"]
    for step in (0, 3):
        assert_same_state(states[step], client.load("run", step))
        assert lossy_tensors(svc, "run", step) == set()
    for step in (1, 2, 4):
        check_lossy(states[step], client.load("run", step))
        moments = {f"optimizer/state/{i}/{k}" for i in (0, 4) for k in ("exp_avg", "exp_avg_sq")}
        # the Linear weights and their moments (biases and BatchNorm stay under MIN_ELEMENTS)
        assert lossy_tensors(svc, "run", step) == {*PAIRED, *moments}
    # exact moments: only the weights are lossy
    assert lossy_tensors(svc, "run", 5) == set(PAIRED)
    loaded = client.load("run", 5)
    for key in ("exp_avg", "exp_avg_sq"):
        for m, r in zip(_moments(states[5], key), _moments(loaded, key), strict=True):
            assert torch.equal(m, r)


@pytest.mark.slow
def test_loads_are_deterministic_and_cold_loads_rebuild_them_or_refuse_corrupt_data(
    chain: dict[str, Any], make_service: Callable[..., Service]
) -> None:
    svc: Service = chain["svc"]
    states = chain["states"]
    first = {step: stored_data(svc, "run", step) for step in range(6)}
    assert {step: stored_data(svc, "run", step) for step in range(6)} == first
    # a second process on a copy of the data, without the base cache: decoded from storage
    copied = svc.data_dir.parent / "cold"
    shutil.copytree(svc.data_dir, copied, ignore=shutil.ignore_patterns("cache", "*.log"))
    cold = make_service(ENV, copied)
    assert stored_data(cold, "run", "latest") == first[5]  # decoded, then cached
    assert stored_data(cold, "run", "latest") == first[5]  # from the cache it filled
    assert {step: stored_data(cold, "run", step) for step in range(6)} == first
    # a flipped byte in a lossy payload (in the indices' zstd frame) of step 2
    with sqlite3.connect(copied / "catalog.sqlite3") as db:
        key, offset, size = db.execute(
            "SELECT k.blob_key, c.blob_offset, c.stored_len FROM chunks c JOIN checkpoints k "
            "ON k.id = c.checkpoint_id JOIN runs r ON r.id = k.run_id WHERE r.name = 'run' "
            "AND k.step = 2 AND c.codec = 'lossy/1' ORDER BY c.stored_len DESC LIMIT 1"
        ).fetchone()
    blob = copied / "blobs" / key
    data = bytearray(blob.read_bytes())
    data[offset + size - 5] ^= 0x01
    blob.write_bytes(bytes(data))
    # a restarted process without the base cache: the one before keeps the chunks it
    # decoded (verified then) and would serve them without reading the blob again, and a
    # restarted one would take back the latest's file (it matches its checksums)
    cold.stop()
    forget_cache(copied)
    cold = make_service(ENV, copied)
    with CheckpointClient(cold.url, retries=0) as client:
        check_lossy(states[1], client.load("run", 1))  # before the corrupt chunk: fine
        for step in (2, 3):  # the corrupt chunk, and the exact save that rests on it
            with pytest.raises(CkptStoreError) as err:
                client.load("run", step)
            assert isinstance(err.value, CorruptData) or "cut its response short" in str(err.value)


def test_the_save_after_a_lossy_one_diffs_against_its_reconstruction(
    chain: dict[str, Any],
) -> None:
    client: CheckpointClient = chain["client"]
    infos = client.list("run")
    # step 3 (exact) rests on step 2's reconstruction: it loads bit-exact (checked above)
    # and stays a delta
    assert infos[3].parent_step == 2 and not infos[3].keyframe
    # a state that equals the reconstruction costs nothing: every chunk is a ref to it
    again = client.load("run", 5)
    info = client.save("run", 6, again)
    assert info.lossy is None and info.stored_bytes == 0
    assert_same_state(again, client.load("run", 6))
    # ... and the next lossy save rests on it: residuals against what loads
    info = client.save("run", 7, chain["states"][5], lossy=True)
    assert info.lossy == DEFAULTS


def test_a_retried_lossy_save_is_idempotent(chain: dict[str, Any]) -> None:
    svc: Service = chain["svc"]
    client: CheckpointClient = chain["client"]
    states = chain["states"]
    before = client.list("run")
    asked = json.dumps(DEFAULTS)
    body, _ = client_body(states[1], {LOSSY_KEY: asked})
    response = post(svc, "run", "1", body)
    assert response.status_code == 200, response.text
    assert response.json()["lossy"] == DEFAULTS
    # the client's retry, with True (the defaults) rather than the parameters
    client.save("run", 1, states[1], lossy=True)
    # other parameters, or none, or other tensors: a different checkpoint
    for lossy in (False, Lossy(bits=3)):
        with pytest.raises(CheckpointExists):
            client.save("run", 1, states[1], lossy=lossy)
    with pytest.raises(CheckpointExists):
        client.save("run", 1, states[2], lossy=True)
    # a checkpoint stored exact holds what any save of the same state asks for
    client.save("run", 0, states[0], lossy=True)
    assert client.list("run") == before


def test_bad_lossy_parameters_are_a_400_that_stores_nothing(chain: dict[str, Any]) -> None:
    svc: Service = chain["svc"]
    client: CheckpointClient = chain["client"]
    state = chain["states"][0]
    for bad in ('{"bits": 99}', '{"weight_prune": 1.5}', '{"colour": "red"}', '"yes"', "[1]", "{"):
        body, _ = client_body(state, {LOSSY_KEY: bad})
        assert_error(post(svc, "bad-lossy", "0", body), 400, "invalid_request")
        assert_error(post(svc, "run", "99", body), 400, "invalid_request")
    assert_nothing_stored(svc, "bad-lossy")
    assert max(i.step for i in client.list("run")) < 99
    # the client refuses them before sending anything
    with pytest.raises(InvalidRequest):
        client.save("bad-lossy", 0, state, lossy={"bits": 0})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        Lossy(moment_prune=-0.1)
    # a checkpoint written in parts cannot be lossy
    prefix, _ = encode_header([("w", "F32", (64,))], {"format": FORMAT, LOSSY_KEY: "true"})
    response = httpx.put(
        f"{svc.url}/v1/runs/parts-lossy/checkpoints/0/parts/rank0", content=prefix + bytes(256)
    )
    assert_error(response, 400, "invalid_request")
    assert "parts" in response.json()["error"]["message"]
    assert_nothing_stored(svc, "parts-lossy")


def test_fqn_keyed_states_pair_their_weights_with_their_moments(chain: dict[str, Any]) -> None:
    svc: Service = chain["svc"]
    trainer = Trainer(seed=1)
    with CheckpointClient(svc.url) as client:
        saved = []
        for step in range(3):
            trainer.train()
            saved.append(trainer.fqn_state())
            client.save("fqn", step, saved[-1], lossy=step > 0)
        moments = {f"optim/state/{n[6:]}/{k}" for n in PAIRED for k in ("exp_avg", "exp_avg_sq")}
        for step in (1, 2):
            assert lossy_tensors(svc, "fqn", step) == {*PAIRED, *moments}
            loaded = client.load("fqn", step)
            for name in PAIRED:
                w = saved[step]["model"][name[6:]]
                assert (loaded["model"][name[6:]] - w).norm() <= 0.05 * w.norm()
            assert loaded["optim"]["param_groups"] == saved[step]["optim"]["param_groups"]
        assert client.list("fqn")[2].lossy == DEFAULTS
        # no optimizer in the state: the weights alone are pruned
        for step in range(2):
            trainer.train()
            client.save("weights", step, {"model": trainer.model.state_dict()}, lossy=True)
        assert lossy_tensors(svc, "weights", 1) == set(PAIRED)
        assert client.list("weights")[0].lossy is None  # a run's first save has no base


@pytest.mark.slow
def test_lossy_chains_through_keyframes_delete_and_fork(
    make_service: Callable[..., Service],
) -> None:
    """Keyframes leave lossy chunks lossy; ``lossy_max_chain_depth`` cuts their chains (the
    chunk stored whole and exact); deleting a checkpoint in a lossy chain and forking a
    lossy checkpoint keep every byte that the others load to."""
    env = {
        **ENV,
        "CKPTSTORE_KEYFRAME_INTERVAL": "2",
        "CKPTSTORE_LOSSY_MAX_CHAIN_DEPTH": "3",
        "CKPTSTORE_GARBAGE_GRACE_S": "0",
    }
    svc = make_service(env)
    trainer = Trainer(seed=2)
    with CheckpointClient(svc.url) as client:
        for step in range(6):
            trainer.train()
            client.save("k", step, trainer.state(), lossy=True)
        wait_idle(svc.url)
        infos = client.list("k")
        # step 0: no base; steps 1-3 lossy on ever deeper chains (keyframes at 2 or not);
        # step 4 would be 4 deep: its paired chunks are stored whole and exact; 5 lossy again
        assert [i.lossy is not None for i in infos] == [False, True, True, True, False, True]
        assert [i.keyframe for i in infos][:2] == [True, False]
        assert infos[3].chain_depth >= 3
        before = {step: stored_data(svc, "k", step) for step in range(6)}
        client.delete("k", 2)  # in the middle of a lossy chain: step 3 is re-based
        client.fork("k", 5, "k-fork")
        wait_idle(svc.url)
        after = {step: stored_data(svc, "k", step) for step in (0, 1, 3, 4, 5)}
        assert after == {step: before[step] for step in after}
        assert stored_data(svc, "k-fork", 5) == before[5]
        assert client.list("k-fork")[0].lossy == DEFAULTS
