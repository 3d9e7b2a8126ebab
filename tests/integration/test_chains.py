"""Every checkpoint of a run reloads bit-exactly: keyframes, chain middles, cache misses."""

from __future__ import annotations

import copy
import sqlite3
from collections.abc import Callable
from typing import Any

import pytest
import torch
import xxhash

from ckptstore import CheckpointClient, CheckpointExists, CheckpointNotFound
from ckptstore import state as state_module
from ckptstore.state import tensor_bytes, upload_order
from ckptstore_core.wire import FORMAT, encode_header
from support.bodies import partial_upload
from support.serviceproc import Service
from support.states import assert_same_state, training_states
from support.waiting import wait_until

KEYFRAME_INTERVAL = 4


@pytest.fixture(scope="module")
def states() -> list[dict[str, Any]]:
    return training_states(10)


@pytest.mark.slow
def test_every_checkpoint_reloads_bit_exactly(
    make_service: Callable[..., Service], states: list[dict[str, Any]], tmp_path: Any
) -> None:
    env = {
        "CKPTSTORE_KEYFRAME_INTERVAL": str(KEYFRAME_INTERVAL),
        "CKPTSTORE_CHUNK_BYTES": str(64 << 10),  # several chunks per tensor
    }
    data_dir = tmp_path / "data"
    svc = make_service(env, data_dir)
    with CheckpointClient(svc.url) as client:
        infos = [client.save("mlp", 10 * i, s) for i, s in enumerate(states)]
        assert [i.keyframe for i in infos] == [i % KEYFRAME_INTERVAL == 0 for i in range(10)]
        assert [i.parent_step for i in infos] == [None] + [10 * i for i in range(9)]
        # deltas since the keyframe, plus one for the bf16 copies cast from the fp32 model
        assert max(i.chain_depth for i in infos) == KEYFRAME_INTERVAL
        assert sum(i.stored_bytes for i in infos) < 0.8 * sum(i.raw_bytes for i in infos)
        for i, state in enumerate(states):  # decoded from storage, through the chains
            assert_same_state(state, client.load("mlp", 10 * i))
        assert_same_state(states[-1], client.load("mlp"))  # latest: from the base cache
        listed = client.list("mlp")
        assert [c.step for c in listed] == [10 * i for i in range(10)]
        assert client.runs()[0].checkpoints == 10

    svc.stop()  # after a restart the base cache holds nothing until a load or save asks
    svc = make_service(env, data_dir)
    cache = data_dir / "cache" / "slot-0"  # the only process: the first slot
    with CheckpointClient(svc.url) as client:
        assert list(cache.glob("*.bin")) == []
        client.load("mlp", 50)  # not the latest: decoded, not cached
        assert list(cache.glob("*.bin")) == []
        # the file the last process left, checked against the checksums, kept as the base
        assert_same_state(states[-1], client.load("mlp"))
        (cached,) = cache.glob("*.bin")
        assert cached.stat().st_size == infos[-1].raw_bytes
    svc.stop()
    svc = make_service(env, data_dir)
    with CheckpointClient(svc.url) as client:
        extra = copy.deepcopy(states[-1])
        extra["step"] = 100
        info = client.save("mlp", 100, extra)
        assert info.parent_step == 90 and not info.keyframe
        assert info.stored_bytes < info.raw_bytes / 10  # almost nothing changed
        for i, state in enumerate(states):
            assert_same_state(state, client.load("mlp", 10 * i))
        assert_same_state(extra, client.load("mlp", "latest"))


def test_a_save_overwrites_its_base_file_in_place_and_a_cut_upload_drops_it(
    make_service: Callable[..., Service], tmp_path: Any
) -> None:
    data_dir = tmp_path / "data"
    svc = make_service({"CKPTSTORE_CHUNK_BYTES": str(64 << 10)}, data_dir)
    cache = data_dir / "cache" / "slot-0"
    g = torch.Generator().manual_seed(3)
    n = 1 << 20
    states = [{"w": torch.randn(n, generator=g)}]
    for _ in range(3):
        states.append({"w": states[-1]["w"] + 1e-3 * torch.randn(n, generator=g)})
    with CheckpointClient(svc.url) as client:
        client.save("ip", 1, states[0])
        (first,) = cache.glob("*.bin")
        inode = first.stat().st_ino
        client.save("ip", 2, states[1])
        (second,) = cache.glob("*.bin")
        assert second.name != first.name and second.stat().st_ino == inode  # overwritten
        assert list((cache / "tmp").iterdir()) == []  # no second file for the run

        # an upload cut off midway, after it began to overwrite checkpoint 2's file
        prefix, header = encode_header([("w", "F32", (n,))], {"format": FORMAT})
        new = tensor_bytes(states[2]["w"])
        sock = partial_upload(svc.url, "ip", 3, prefix + bytes(new[: 2 * n]), header.total_len)
        wait_until(lambda: not list(cache.glob("*.bin")), what="the save took its base")
        assert list(cache.glob("*.bin")) == []  # taken out of the cache: loads miss
        sock.close()
        wait_until(lambda: not list((cache / "tmp").iterdir()), what="the torn base dropped")
        assert list((cache / "tmp").iterdir()) == []  # half overwritten: dropped
        assert [c.step for c in client.list("ip")] == [1, 2]
        assert_same_state(states[1], client.load("ip"))  # decoded from storage
        client.save("ip", 3, states[2])
        (third,) = cache.glob("*.bin")
        inode = third.stat().st_ino

        # a larger tensor added goes first and moves ``w``: the save writes a file of its own
        moved = {"big": torch.ones(n + 1000), **states[3]}
        client.save("ip", 4, moved)
        (fourth,) = cache.glob("*.bin")
        assert fourth.stat().st_ino != inode
        for step, state in zip((1, 2, 3, 4), [*states[:3], moved], strict=True):
            assert_same_state(state, client.load("ip", step))


def test_prefix_idempotent_retry_and_conflict(
    service: Service, states: list[dict[str, Any]]
) -> None:
    with CheckpointClient(service.url) as client:
        first = client.save("retry", 7, states[0])
        again = client.save("retry", 7, states[0])  # a retry after a lost response
        assert again == first
        with pytest.raises(CheckpointExists):
            client.save("retry", 7, states[1])
        assert_same_state(states[0], client.load("retry", 7))
        model_only = client.load("retry", 7, prefix="model/")
        assert list(model_only) == ["model"]
        assert_same_state(states[0]["model"], model_only["model"])
        with pytest.raises(CheckpointNotFound):
            client.load("retry", 8)
        # an older step saved after a newer one gets the right parent, latest stays newest
        client.save("retry", 9, states[2])
        middle = client.save("retry", 8, states[1])
        assert middle.parent_step == 7
        assert_same_state(states[2], client.load("retry"))
        assert_same_state(states[1], client.load("retry", 8))


def test_a_retry_in_another_tensor_order_is_the_same_checkpoint(
    service: Service, states: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # an older (or other) client streams the same tensors in another order
    with CheckpointClient(service.url) as client:
        first = client.save("order", 1, states[0])
        monkeypatch.setattr(
            state_module, "upload_order", lambda tensors: upload_order(tensors)[::-1]
        )
        assert client.save("order", 1, states[0]) == first
        with pytest.raises(CheckpointExists):
            client.save("order", 1, states[1])
        assert_same_state(states[0], client.load("order", 1))


def test_many_small_tensors_after_a_large_one(service: Service) -> None:
    # the small ones are encoded in the ingest thread and queue up behind the large one
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(3_000_000, generator=g)}
    state |= {f"small{i}": torch.randn(1 + i % 50, generator=g) for i in range(3000)}
    with CheckpointClient(service.url) as client:
        client.save("small", 1, state)
        nxt = {k: v * 1.001 if k.startswith("small1") else v for k, v in state.items()}
        client.save("small", 2, nxt)
        assert_same_state(state, client.load("small", 1))
        assert_same_state(nxt, client.load("small", 2))


def test_bf16_weights_are_predicted_from_their_fp32_master(service: Service) -> None:
    """Mixed precision: the bf16 model is round(fp32 master), so it should cost ~nothing."""
    g = torch.Generator().manual_seed(5)
    master = {f"layer{i}.weight": torch.randn(256, 1024, generator=g) for i in range(4)}
    model = {k: v.to(torch.bfloat16) for k, v in master.items()}
    odd = model["layer3.weight"].clone()
    odd[0, :7] += 1  # not every copy is an exact rounding: still bit-exact, just costs bytes
    model["layer3.weight"] = odd
    half = {"layer0.weight": master["layer0.weight"].half()}
    state = {"model": model, "master": master, "fp16": half, "step": 1}
    with CheckpointClient(service.url) as client:
        info = client.save("mixed", 1, state)
        alone = client.save("master-only", 1, {"master": master})
        derived = info.stored_bytes - alone.stored_bytes
        bf16_raw = sum(t.numel() * 2 for t in model.values()) + 256 * 1024 * 2
        assert derived < bf16_raw / 50, (derived, bf16_raw)
        assert_same_state(state, client.load("mixed", 1))
        only_model = client.load("mixed", 1, prefix="model/")  # needs the master's chunks
        assert_same_state({"model": model}, only_model)
        nxt = {**state, "master": {k: v + 0.01 for k, v in master.items()}}
        nxt["model"] = {k: v.to(torch.bfloat16) for k, v in nxt["master"].items()}
        client.save("mixed", 2, nxt)
        assert_same_state(nxt, client.load("mixed", 2))
        assert_same_state(state, client.load("mixed", 1))


def test_empty_tensors_reload(service: Service) -> None:
    # no chunks at all: a restore checks them against their tensor (zero bytes) all the same
    state = {"e": torch.empty(0), "z": torch.zeros(0, 5), "w": torch.randn(64, 64), "step": 1}
    with CheckpointClient(service.url) as client:
        client.save("empty", 1, state)
        client.save("empty", 2, {**state, "step": 2})
        assert_same_state(state, client.load("empty", 1))  # decoded from storage
        assert_same_state({**state, "step": 2}, client.load("empty"))  # from the base cache


def test_tensor_checksums_are_the_xxh3_of_their_bytes(
    make_service: Callable[..., Service], tmp_path: Any
) -> None:
    # a tensor of one chunk takes its chunk's checksum; one of several is hashed as it streams
    svc = make_service({"CKPTSTORE_CHUNK_BYTES": str(64 << 10)}, tmp_path / "data")
    state = {
        "one": torch.randn(100),
        "several": torch.randn(50_000),  # 200 KB: four chunks
        "empty": torch.empty(0),
        "edge": torch.randn(16 << 10),  # exactly one chunk
    }
    with CheckpointClient(svc.url) as client:
        client.save("sums", 1, state)
    db = sqlite3.connect(tmp_path / "data" / "catalog.sqlite3")
    try:
        stored = dict(db.execute("SELECT name, checksum FROM tensors").fetchall())
    finally:
        db.close()
    expected = {k: xxhash.xxh3_128_digest(tensor_bytes(t)) for k, t in state.items()}
    assert stored == expected
