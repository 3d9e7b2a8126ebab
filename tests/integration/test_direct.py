"""Parts encoded by their writer (direct=True) against a real service: chains that mix
client-encoded and service-encoded checkpoints load exactly, the verifier marks each
client-encoded checkpoint verified, and a writer's wrong bytes or rows are caught (the
wrong checkpoint alone marked corrupt; refused rows a clear 4xx that stores nothing)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from ckptstore.direct import DirectWriter, Sent, pieces_of
from ckptstore.transport import Transport
from ckptstore_core import codec
from ckptstore_core.encoded import CONTENT_TYPE, TailChunk, encode_tail, frame
from ckptstore_core.wire import FORMAT, encode_header
from support.bodies import assert_error, stored_data
from support.serviceproc import Service, verdicts

Spec = tuple[str, str, tuple[int, ...]]
FAST_VERIFIER = {"CKPTSTORE_VERIFY_INTERVAL_S": "0.2", "CKPTSTORE_VERIFY_CPU_SHARE": "1"}


class Writer:
    """A DirectWriter of its own, saving single-part checkpoints (``direct``) of one run."""

    def __init__(self, service: Service, run: str) -> None:
        self.transport = Transport(service.url, timeout=60)
        self.run = run
        self.direct = DirectWriter(workers=2)

    def save(self, step: int, arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> Sent:
        specs = [(n, dtypes[n], a.shape) for n, a in arrays.items()]
        path = f"/v1/runs/{self.run}/checkpoints/{step}"
        views = [memoryview(a.tobytes()) for a in arrays.values()]
        sent = self.direct.save_part(
            self.transport, path, self.run, "direct", specs, lambda: pieces_of(views)
        )
        commit = {"parts": ["direct"], "metadata": {"format": FORMAT}}
        self.transport.call("POST", path + "/commit", commit)
        self.direct.keep(sent)
        return sent

    def close(self) -> None:
        self.direct.close()
        self.transport.close()


def state(step: int) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A training-like state: weights drifting a little per step, an fp32 master with its
    bf16 copy, a frozen embedding, a counter."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 300)).astype(np.float32)
    drift = np.random.default_rng(step).standard_normal(w.shape).astype(np.float32)
    master = w + np.float32(1e-4 * step) * drift
    bf16 = (master.view(np.uint32) >> 16).astype(np.uint16)  # rounded down: a copy of it
    frozen = rng.integers(0, 1000, 100_000).astype(np.int32)
    arrays = {
        "master/w": master,
        "model/w": bf16,
        "frozen": frozen,
        "step": np.array([step], np.int64),
    }
    dtypes = {"master/w": "F32", "model/w": "BF16", "frozen": "I32", "step": "I64"}
    return arrays, dtypes


def raw_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    return b"".join(a.tobytes() for a in arrays.values())


def service_save(service: Service, run: str, step: int, arrays: dict[str, np.ndarray]) -> None:
    dtypes = state(step)[1]
    head = encode_header([(n, dtypes[n], a.shape) for n, a in arrays.items()], {})[0]
    url = f"{service.url}/v1/runs/{run}/checkpoints/{step}"
    response = httpx.post(url, content=head + raw_bytes(arrays), timeout=60)
    assert response.status_code == 201, response.text


def test_a_chain_of_direct_and_service_saves_loads_exactly_and_is_verified(
    make_service: Callable[..., Service],
) -> None:
    service = make_service(FAST_VERIFIER)
    writer = Writer(service, "mix")
    try:
        saved = {}
        for step in (1, 2):
            arrays, dtypes = state(step)
            writer.save(step, arrays, dtypes)
            saved[step] = raw_bytes(arrays)
        arrays = state(3)[0]
        service_save(service, "mix", 3, arrays)  # the service encodes this one
        saved[3] = raw_bytes(arrays)
        arrays, dtypes = state(4)
        writer.save(4, arrays, dtypes)  # its base file is step 2's: only unchanged tensors
        saved[4] = raw_bytes(arrays)
    finally:
        writer.close()

    for step, data in saved.items():
        assert stored_data(service, "mix", step) == data, step
    listed = verdicts(service.url, "mix")
    assert [listed[s]["verification"] for s in (1, 2, 3, 4)] == [
        "verified",
        "verified",
        "service",
        "verified",
    ]
    # step 2 was encoded against step 1's bytes, which its writer held: deltas and refs
    assert listed[2]["stored_bytes"] < listed[1]["stored_bytes"] / 2
    assert listed[2]["parent_step"] == 1 and not listed[2]["keyframe"]


def encoded_body(
    specs: list[Spec],
    frames: list[bytes],
    rows: list[TailChunk],
    sums: list[bytes],
    parent: int | None,
) -> bytes:
    head = encode_header(specs, {"format": FORMAT})[0]
    body = head + b"".join(frame(len(f)) + f for f in frames)
    return body + encode_tail(parent, rows, sums)


def put_encoded(service: Service, run: str, step: int, body: bytes) -> httpx.Response:
    return httpx.put(
        f"{service.url}/v1/runs/{run}/checkpoints/{step}/parts/direct/encoded",
        content=body,
        headers={"Content-Type": CONTENT_TYPE},
    )


def commit(service: Service, run: str, step: int) -> httpx.Response:
    return httpx.post(
        f"{service.url}/v1/runs/{run}/checkpoints/{step}/commit",
        json={"parts": ["direct"], "metadata": {"format": FORMAT}},
    )


def test_wrong_bytes_under_honest_checksums_mark_that_checkpoint_alone_corrupt(
    make_service: Callable[..., Service],
) -> None:
    service = make_service(FAST_VERIFIER)
    good = np.arange(1000, dtype=np.float32).tobytes()
    specs: list[Spec] = [("w", "F32", (1000,))]
    ck = codec.checksum(good)
    row = TailChunk(0, 0, 4000, codec.RAW, ck)
    for step, payload in ((1, good), (2, bytes(4000)), (3, good)):  # step 2 lies
        body = encoded_body(specs, [payload], [row], [ck], parent_id(service, "liar", step))
        assert put_encoded(service, "liar", step, body).status_code == 201
        assert commit(service, "liar", step).status_code == 201

    listed = verdicts(service.url, "liar")
    assert {s: c["verification"] for s, c in listed.items()} == {
        1: "verified",
        2: "corrupt",
        3: "verified",
    }
    assert_error(httpx.get(f"{service.url}/v1/runs/liar/checkpoints/2"), 500, "corrupt_data")
    assert stored_data(service, "liar", 1) == good
    assert stored_data(service, "liar", 3) == good
    metrics = httpx.get(f"{service.url}/metrics").text
    assert 'ckptstore_verifications_total{result="corrupt"} 1.0' in metrics


def parent_id(service: Service, run: str, step: int) -> int | None:
    """The parent a writer must name: the plan's."""
    url = f"{service.url}/v1/runs/{run}/checkpoints/{step}/plan"
    response = httpx.post(url, json={"names": ["w"]})
    assert response.status_code == 200, response.text
    found: int | None = response.json()["parent_id"]
    return found


@pytest.mark.parametrize(
    ("case", "status", "code"),
    [
        ("delta without a parent", 400, "invalid_stream"),
        ("another cut", 400, "invalid_stream"),
        ("a ref with bytes", 400, "invalid_stream"),
        ("a parent that is not the step's", 409, "checkpoint_exists"),
        ("tensor checksum not its chunk's", 400, "invalid_stream"),
    ],
)
def test_rows_the_plan_does_not_allow_are_refused_and_store_nothing(
    service: Service, case: str, status: int, code: str
) -> None:
    data = np.arange(1000, dtype=np.float32).tobytes()
    ck = codec.checksum(data)
    specs: list[Spec] = [("w", "F32", (1000,))]
    row, payload, sums, parent = TailChunk(0, 0, 4000, codec.RAW, ck), data, [ck], None
    if case == "delta without a parent":
        row = TailChunk(0, 0, 4000, "sub/1|planes4/1|zstd/1", ck)
    elif case == "another cut":
        row = TailChunk(0, 4, 3996, codec.RAW, ck)
    elif case == "a ref with bytes":
        row = TailChunk(0, 0, 4000, codec.REF, ck)
    elif case == "a parent that is not the step's":
        parent = 12345
    else:
        sums = [bytes(16)]
    run = "refused-" + case.replace(" ", "-").replace("'", "")
    response = put_encoded(service, run, 1, encoded_body(specs, [payload], [row], sums, parent))
    assert_error(response, status, code)
    assert_error(commit(service, run, 1), 400, "invalid_request")  # no part was stored
    assert run not in {r["name"] for r in httpx.get(f"{service.url}/v1/runs").json()["runs"]}


def test_checkpoint_client_direct_saves_a_training_run_exactly(
    make_service: Callable[..., Service],
) -> None:
    """``CheckpointClient(direct=True)`` on a real AdamW run in mixed dtypes (bf16 copies,
    a frozen embedding, RNG and scheduler state): each step loads back bit for bit, also
    across a service-encoded step in the middle of the chain."""
    from ckptstore import CheckpointClient
    from support.states import assert_same_state, training_states

    service = make_service(FAST_VERIFIER)
    states = training_states(4)
    with (
        CheckpointClient(service.url, direct=True) as direct,
        CheckpointClient(service.url) as plain,
    ):
        for step, state in enumerate(states, start=1):
            (plain if step == 3 else direct).save("train", step, state)
        for step, state in enumerate(states, start=1):
            assert_same_state(state, plain.load("train", step), path=f"step {step}")
    listed = verdicts(service.url, "train")
    assert [listed[s]["verification"] for s in (1, 2, 3, 4)] == [
        "verified",
        "verified",
        "service",
        "verified",
    ]
    assert listed[2]["stored_bytes"] < listed[1]["stored_bytes"]


@pytest.mark.slow
def test_dcp_ranks_encode_their_own_parts_and_load_into_other_world_sizes(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    """3 FSDP2 ranks save steps 2 and 4 with ``CkptStoreWriter(direct=True)``; 2 ranks
    (decoding their reads themselves, ``CkptStoreReader(direct=True)``) and 1 rank load both
    bit for bit; the service verified what the ranks encoded."""
    from support import dcp_ranks
    from support.states import assert_same_state

    service = make_service(FAST_VERIFIER)
    saved = tmp_path / "saved"
    saved.mkdir()
    dcp_ranks.launch(dcp_ranks.save_run, 3, service.url, "dcp", str(saved), [2, 4], 4, True)
    for world in (2, 1):
        out = tmp_path / f"loaded-{world}"
        out.mkdir()
        direct = world == 2
        dcp_ranks.launch(
            dcp_ranks.load_run, world, service.url, "dcp", str(out), [2, 4], [], direct
        )
        for step in (2, 4):
            assert_same_state(
                torch.load(saved / f"full-{step}.pt", weights_only=True),
                torch.load(out / f"loaded-{world}-{step}.pt", weights_only=True),
                path=f"world {world}, step {step}",
            )
    listed = verdicts(service.url, "dcp")
    assert {s: (c["verification"], c["parts"]) for s, c in listed.items()} == {
        2: ("verified", 3),
        4: ("verified", 3),
    }
    assert listed[4]["parent_step"] == 2


def test_a_direct_save_run_again_is_accepted_and_other_content_refused(
    make_service: Callable[..., Service],
) -> None:
    """A direct save of a step committed already (its answer lost, the save run again under
    a new part name): the same tensors and metadata are the same save, nothing stored; other
    tensors, or the same tensors with other metadata, a 409."""
    from ckptstore import CheckpointClient, CheckpointExists

    service = make_service()
    state = {"w": torch.arange(70_000, dtype=torch.float32), "step": 3}
    with CheckpointClient(service.url, direct=True) as client:
        first = client.save("again", 1, state)
        blobs = sorted(p.name for p in service.data_dir.rglob("*.blob"))
        again = client.save("again", 1, state)
        assert (again.step, again.stored_bytes, again.created) == (
            1,
            first.stored_bytes,
            first.created,
        )
        assert sorted(p.name for p in service.data_dir.rglob("*.blob")) == blobs
        with pytest.raises(CheckpointExists, match="other content"):
            client.save("again", 1, {**state, "w": state["w"] + 1})
        with pytest.raises(CheckpointExists, match="other metadata"):
            client.save("again", 1, {**state, "step": 4})
        assert [c.step for c in client.list("again")] == [1]
