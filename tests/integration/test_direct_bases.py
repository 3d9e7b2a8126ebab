"""Bases after a load (``direct=True``): a resumed job's first direct save diffs against the
state it loaded, not only against what it saved itself, and every step loads bit for bit
whether the step it loaded is the run's latest or an older one. Each "process" here is a
fresh process-wide writer (:func:`ckptstore.direct.shared_writer`), as a restarted job
starts with none."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstore.direct
from ckptstore import CheckpointClient
from support.serviceproc import Service, verdicts
from support.states import assert_same_state, plain_dicts

FAST_VERIFIER = {"CKPTSTORE_VERIFY_INTERVAL_S": "0.2", "CKPTSTORE_VERIFY_CPU_SHARE": "1"}


@pytest.fixture
def new_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Call it to start a "new process": the next direct save or load makes a writer of
    its own, which holds no base yet (the test's writers are closed at its end)."""
    made: list[ckptstore.direct.DirectWriter] = []

    def restart() -> None:
        if ckptstore.direct._shared is not None:
            made.append(ckptstore.direct._shared)
        monkeypatch.setattr(ckptstore.direct, "_shared", None)

    restart()
    yield restart
    restart()
    for writer in made[1:]:  # the first is the one the session had before this test
        writer.close()


def state(step: int) -> dict[str, Any]:
    """A training-like state: fp32 weights drifting a little per step with their bf16
    copy, a frozen embedding (the same at every step), a step counter."""
    w = torch.randn(256, 300, generator=torch.Generator().manual_seed(0))
    drift = torch.randn(w.shape, generator=torch.Generator().manual_seed(step))
    master = w + 1e-4 * step * drift
    return {
        "master": {"w": master},
        "model": {"w": master.to(torch.bfloat16)},
        "frozen": {"emb": _frozen()},
        "step": step,
    }


def _frozen() -> torch.Tensor:
    seeded = torch.Generator().manual_seed(7)
    return torch.randint(0, 1000, (100_000,), dtype=torch.int32, generator=seeded)


def assert_loads_exactly(service: Service, run: str, steps: dict[int, dict[str, Any]]) -> None:
    """Every step of ``steps`` loads to its state, decoded here and by the service."""
    with (
        CheckpointClient(service.url, direct=True) as direct,
        CheckpointClient(service.url) as plain,
    ):
        for step, expected in steps.items():
            for client in (direct, plain):
                got = client.load(run, step)
                assert_same_state(expected, got, path=f"{run} step {step}")


def test_a_resumed_job_diffs_its_first_direct_save_against_what_it_loaded(
    make_service: Callable[..., Service], new_process: Callable[[], None]
) -> None:
    """Steps 1-2 saved by one process; a new process loads step 2 and saves step 3: a delta
    (as small as step 2, a delta of the first process's own base). The control, a new
    process that saves step 3 without a load, stores it self-contained."""
    service = make_service(FAST_VERIFIER)
    with CheckpointClient(service.url, direct=True) as client:
        for run in ("resumed", "cold"):
            client.save(run, 1, state(1))
            client.save(run, 2, state(2))
    new_process()
    with CheckpointClient(service.url, direct=True, read_bases=False) as client:
        assert_same_state(state(2), client.load("resumed", 2), path="loaded")
        client.save("resumed", 3, state(3))
        client.save("cold", 3, state(3))
    new_process()
    resumed, cold = verdicts(service.url, "resumed"), verdicts(service.url, "cold")
    keyframe = resumed[1]["stored_bytes"]
    assert resumed[3]["parent_step"] == 2
    assert resumed[3]["stored_bytes"] < keyframe / 2
    assert resumed[3]["stored_bytes"] < 1.2 * resumed[2]["stored_bytes"]
    assert cold[3]["stored_bytes"] > 0.9 * keyframe  # no base: encoded self-contained
    assert {s: c["verification"] for s, c in resumed.items()} == dict.fromkeys(
        (1, 2, 3), "verified"
    )
    assert_loads_exactly(service, "resumed", {s: state(s) for s in (1, 2, 3)})


def test_a_job_that_loads_an_older_step_saves_exactly(
    make_service: Callable[..., Service], new_process: Callable[[], None]
) -> None:
    """A new process loads step 1 (not the latest) and saves step 3, whose parent is step
    2: without ``read_bases`` only what step 2 holds unchanged (the frozen embedding) is
    diffed against the loaded bytes, the rest is self-contained; with it (run
    ``older-read``), the rest is read from step 2 in the store and diffed too. Every step
    loads bit for bit."""
    service = make_service(FAST_VERIFIER)
    with CheckpointClient(service.url, direct=True) as client:
        for run in ("older", "older-read"):
            client.save(run, 1, state(1))
            client.save(run, 2, state(2))
    for run, read in (("older", False), ("older-read", True)):
        new_process()
        with CheckpointClient(service.url, direct=True, read_bases=read) as client:
            assert_same_state(state(1), client.load(run, 1), path="loaded")
            client.save(run, 3, state(3))
    new_process()
    listed, read = verdicts(service.url, "older"), verdicts(service.url, "older-read")
    assert listed[3]["parent_step"] == 2
    frozen_bytes = _frozen().numel() * 4
    # the frozen embedding became references to step 2's chunks; nothing else was diffed
    assert listed[3]["stored_bytes"] < listed[1]["stored_bytes"] - frozen_bytes / 4
    assert listed[3]["stored_bytes"] > 1.5 * listed[2]["stored_bytes"]
    assert read[3]["stored_bytes"] < 1.2 * read[2]["stored_bytes"]
    for run, got in (("older", listed), ("older-read", read)):
        assert {s: c["verification"] for s, c in got.items()} == dict.fromkeys(
            (1, 2, 3), "verified"
        )
        assert_loads_exactly(service, run, {s: state(s) for s in (1, 2, 3)})


def test_a_prefix_load_keeps_the_rest_of_the_base(
    make_service: Callable[..., Service], new_process: Callable[[], None]
) -> None:
    """A process loads a run's tensors in two prefixes (the model, then the rest): its base
    holds both, and its next save diffs every tensor; a process that saved step 2 and then
    loads only the model of it keeps diffing the rest against its own save."""
    service = make_service(FAST_VERIFIER)
    with CheckpointClient(service.url, direct=True) as client:
        for run in ("halves", "eval"):
            client.save(run, 1, state(1))
            client.save(run, 2, state(2))
        client.load("eval", 2, prefix="model/")  # an evaluation between saves
        client.save("eval", 3, state(3))
    new_process()
    with CheckpointClient(service.url, direct=True) as client:
        client.load("halves", 2, prefix="master/")
        client.load("halves", 2, prefix="frozen/")
        client.save("halves", 3, state(3))
    new_process()
    for run in ("halves", "eval"):
        listed = verdicts(service.url, run)
        assert listed[3]["stored_bytes"] < 1.2 * listed[2]["stored_bytes"], run
        assert_loads_exactly(service, run, {s: state(s) for s in (2, 3)})


@pytest.mark.slow
def test_dcp_ranks_resumed_from_a_direct_load_save_deltas(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    """2 FSDP2 ranks save steps 1 and 2 direct; restarted ranks load step 2 with
    ``CkptStoreReader(direct=True)`` and save step 3 direct: each rank's part diffs against
    the pieces it loaded. The control (restarted ranks that load through the service, and
    read no bases from the store) saves step 3 self-contained. Every step loads bit for
    bit, through ``load_full(direct=True)`` too."""
    from ckptstore.dcp import load_full
    from support import dcp_ranks

    service = make_service(FAST_VERIFIER)
    for run, load_direct in (("dcp-resumed", True), ("dcp-cold", False)):
        out = tmp_path / run
        out.mkdir()
        dcp_ranks.launch(dcp_ranks.save_run, 2, service.url, run, str(out), [1, 2], 2, True)
        dcp_ranks.launch(
            dcp_ranks.resumed_save, 2, service.url, run, str(out), 3, (load_direct, True),
            load_direct,
        )  # fmt: skip
    resumed, cold = verdicts(service.url, "dcp-resumed"), verdicts(service.url, "dcp-cold")
    assert resumed[3]["parent_step"] == 2
    assert resumed[3]["stored_bytes"] < 0.8 * cold[3]["stored_bytes"]
    assert {s: c["verification"] for s, c in resumed.items()} == dict.fromkeys(
        (1, 2, 3), "verified"
    )
    out = tmp_path / "dcp-resumed"
    for step in (1, 2, 3):
        expected = torch.load(out / f"full-{step}.pt", weights_only=True)
        for direct in (True, False):
            got = load_full(service.url, "dcp-resumed", step, direct=direct)
            assert_same_state(plain_dicts(expected), got, path=f"step {step}, direct={direct}")
    model_only = load_full(service.url, "dcp-resumed", 3, prefix="model.", direct=True)
    assert list(model_only) == ["model"]
    expected = torch.load(out / "full-3.pt", weights_only=True)["model"]
    assert_same_state(plain_dicts(expected), model_only["model"], path="model at step 3")


def test_a_direct_select_holds_one_tensor_at_a_time(
    make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch, new_process: Any
) -> None:
    """A DCP rank's direct read (``parts.select(direct=True)``) hands each tensor over as it
    is decoded: with the decoder's read-ahead cut to 4 MiB, reading 12 tensors of 8 MiB
    peaks near one tensor plus the read-ahead, not at the 96 MiB of all of them."""
    import tracemalloc

    import xxhash

    import ckptstore.direct_load
    from ckptstore import parts

    service = make_service()
    n, size = 12, 2 << 20  # fp32 elements: 8 MiB a tensor
    state = {f"t{i:02d}": torch.arange(size, dtype=torch.float32) * (i + 1) for i in range(n)}
    with CheckpointClient(service.url, direct=True) as client:
        client.save("wide", 1, state)
        names = [t["name"] for t in parts.info(client, "wide", 1)["tensors"]]
        monkeypatch.setattr(ckptstore.direct_load, "_AHEAD", 4 << 20)
        sums: dict[str, bytes] = {}

        def consume(spec: Any, data: memoryview) -> None:
            sums[spec.name] = xxhash.xxh3_128_digest(data)

        tracemalloc.start()
        try:
            got = parts.select(client, "wide", 1, names, consume, direct=True)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert got == n * size * 4
    expected = {k: xxhash.xxh3_128_digest(v.numpy().data) for k, v in state.items()}
    assert sums == {name: expected[name] for name in names}
    assert peak < 40 << 20, f"peak {peak / 2**20:.1f} MiB"


def test_a_base_file_changed_on_disk_is_no_base_for_the_chunk_it_spoils(
    make_service: Callable[..., Service],
    new_process: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A byte of the loaded base flipped on disk (the tensors' checksums matched when it
    was written): the chunk it spoils fails the plan's chunk checksum, so it is encoded on
    its own (and a warning says so) instead of as a delta that would decode wrong; the
    other chunks stay deltas, the verifier passes the checkpoint, every step loads exactly."""
    service = make_service(FAST_VERIFIER)
    with CheckpointClient(service.url, direct=True) as client:
        client.save("tampered", 1, state(1))
        client.save("tampered", 2, state(2))
    new_process()
    with CheckpointClient(service.url, direct=True) as client:
        client.load("tampered", 2)
        writer = ckptstore.direct._shared
        assert writer is not None
        (base,) = writer._bases.values()
        (master,) = [t for t in base.tensors if t.name == "master/w"]
        with open(base.path, "r+b") as f:
            f.seek(master.begin + 1000)
            byte = f.read(1)
            f.seek(master.begin + 1000)
            f.write(bytes([byte[0] ^ 0x10]))
        with caplog.at_level("WARNING", logger="ckptstore"):
            client.save("tampered", 3, state(3))
    assert "differs from the parent's chunk" in caplog.text
    new_process()
    listed = verdicts(service.url, "tampered")
    assert {s: c["verification"] for s, c in listed.items()} == dict.fromkeys((1, 2, 3), "verified")
    assert listed[3]["stored_bytes"] < listed[1]["stored_bytes"]
    assert_loads_exactly(service, "tampered", {s: state(s) for s in (1, 2, 3)})


def test_a_new_process_reads_its_base_from_the_stored_parent(
    make_service: Callable[..., Service],
    new_process: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A process that neither saved nor loaded run ``read`` saves its step 2: with
    ``read_bases`` it reads step 1's tensors from the store (ranges + the core's decoder,
    each checked) and stores step 2 as a delta, as small as the saving process's own delta
    (run ``own``); without, step 2 is self-contained (run ``cold``). Every step loads bit
    for bit and is verified."""
    service = make_service(FAST_VERIFIER)
    with CheckpointClient(service.url, direct=True) as client:
        for run in ("read", "cold", "own"):
            client.save(run, 1, state(1))
        client.save("own", 2, state(2))
    new_process()
    for run, read in (("read", True), ("cold", False)):
        with (
            CheckpointClient(service.url, direct=True, read_bases=read) as client,
            caplog.at_level("WARNING", logger="ckptstore"),
        ):
            client.save(run, 2, state(2))
        new_process()
    assert "could not be read" not in caplog.text
    read, cold, own = (verdicts(service.url, run) for run in ("read", "cold", "own"))
    keyframe = read[1]["stored_bytes"]
    assert read[2]["parent_step"] == 1
    assert read[2]["stored_bytes"] < keyframe / 2
    assert read[2]["stored_bytes"] < 1.2 * own[2]["stored_bytes"]
    assert cold[2]["stored_bytes"] > 0.9 * keyframe
    assert {s: c["verification"] for s, c in read.items()} == {1: "verified", 2: "verified"}
    assert_loads_exactly(service, "read", {s: state(s) for s in (1, 2)})


def test_a_corrupt_stored_parent_is_no_base(
    make_service: Callable[..., Service],
    new_process: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Step 1's blob has a byte flipped every 16 KiB in the store (every chunk): reading
    it as a base fails its checksum, so a new process's step 2 is encoded self-contained
    (a warning says so) and loads bit for bit; with the bytes put back, step 1 loads
    exactly too."""
    service = make_service(FAST_VERIFIER)
    with CheckpointClient(service.url, direct=True) as client:
        client.save("rotten", 1, state(1))
    verdicts(service.url, "rotten")
    (blob,) = service.data_dir.rglob("*.blob")
    clean = blob.read_bytes()
    rotten = bytearray(clean)
    for at in range(4096, len(rotten), 16 << 10):
        rotten[at] ^= 0x10
    blob.write_bytes(rotten)
    new_process()
    with (
        CheckpointClient(service.url, direct=True, read_bases=True) as client,
        caplog.at_level("WARNING", logger="ckptstore"),
    ):
        client.save("rotten", 2, state(2))
    assert "could not be read as a base" in caplog.text
    blob.write_bytes(clean)
    new_process()
    listed = verdicts(service.url, "rotten")
    assert listed[2]["verification"] == "verified"
    assert listed[2]["stored_bytes"] > 0.9 * listed[1]["stored_bytes"]
    assert_loads_exactly(service, "rotten", {s: state(s) for s in (1, 2)})


def test_a_stored_parent_whose_checksum_is_not_the_plans_is_not_read(
    make_service: Callable[..., Service],
    new_process: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The plan names a checksum for the parent's ``master/w`` that the stored tensor does
    not have (a plan and a store that disagree): that tensor is not read as a base (a
    warning says so) and is encoded self-contained; the others are read and diffed; the
    save loads bit for bit."""
    from ckptstore_core.encoded import Plan

    service = make_service(FAST_VERIFIER)
    with CheckpointClient(service.url, direct=True) as client:
        client.save("disagree", 1, state(1))
    new_process()
    planned = Plan.from_json

    def wrong_master(doc: dict[str, Any]) -> Plan:
        plan = planned(doc)
        tensors = tuple(
            replace(t, checksum=bytes(16)) if t.name == "master/w" else t for t in plan.tensors
        )
        return replace(plan, tensors=tensors)

    with (
        pytest.MonkeyPatch.context() as patch,
        CheckpointClient(service.url, direct=True, read_bases=True) as client,
        caplog.at_level("WARNING", logger="ckptstore"),
    ):
        patch.setattr(ckptstore.direct.Plan, "from_json", staticmethod(wrong_master))
        client.save("disagree", 2, state(2))
    assert "differ from the plan's checksums" in caplog.text
    listed = verdicts(service.url, "disagree")
    assert listed[2]["verification"] == "verified"
    master = state(2)["master"]["w"].numel() * 4
    # master/w was encoded self-contained, the bf16 copy and the embedding diffed
    assert listed[2]["stored_bytes"] > master / 2
    assert listed[2]["stored_bytes"] < listed[1]["stored_bytes"] - master / 4
    assert_loads_exactly(service, "disagree", {s: state(s) for s in (1, 2)})
