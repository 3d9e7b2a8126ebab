"""Direct loads (``CheckpointClient(direct=True).load``): the service answers the blob ranges,
the client fetches and decodes them. Bit-exact on chains that mix client-encoded and
service-encoded checkpoints, with a prefix, and the client's checksums catch a stored byte
gone wrong; the ranges route serves stored bytes unchanged and only its checkpoint's blobs."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import torch

from ckptstore import CheckpointClient, CorruptData
from support.bodies import assert_error
from support.serviceproc import Service
from support.states import assert_same_state, training_states


def test_a_mixed_chain_loads_exactly_when_the_client_decodes(
    make_service: Callable[..., Service],
) -> None:
    service = make_service()
    states = training_states(5)
    with (
        CheckpointClient(service.url, direct=True) as direct,
        CheckpointClient(service.url) as plain,
    ):
        for step, state in enumerate(states, start=1):
            # steps 2 and 4 encoded by the service, the others by this client
            (plain if step % 2 == 0 else direct).save("mix", step, state)
        for step, state in enumerate(states, start=1):
            assert_same_state(state, direct.load("mix", step), path=f"step {step}")
        assert_same_state(states[-1], direct.load("mix"), path="latest")
        # a prefix: only those tensors, nested as a plain load nests them
        assert_same_state(
            plain.load("mix", 3, prefix="model/"),
            direct.load("mix", 3, prefix="model/"),
            path="prefix",
        )


def test_the_ranges_route_serves_stored_bytes_of_its_checkpoint_only(
    make_service: Callable[..., Service],
) -> None:
    service = make_service()
    with CheckpointClient(service.url, direct=True) as client:
        client.save("r", 1, {"w": torch.arange(50_000, dtype=torch.float32)})
    base = f"{service.url}/v1/runs/r/checkpoints/1"
    layout = httpx.post(base + "/ranges", json={}).json()
    assert [b["url"] for b in layout["blobs"]] == [None]  # local backend: through here
    (blob,) = service.data_dir.rglob("*.blob")
    stored = blob.read_bytes()
    got = httpx.get(f"{base}/blobs/0", params={"start": 3, "end": len(stored)})
    assert got.status_code == 200 and got.content == stored[3:]
    assert_error(
        httpx.get(f"{base}/blobs/1", params={"start": 0, "end": 1}), 400, "invalid_request"
    )
    too_far = {"start": 0, "end": len(stored) + 1}
    assert_error(httpx.get(f"{base}/blobs/0", params=too_far), 400, "invalid_request")
    assert_error(httpx.post(base + "/ranges", json={"names": ["nope"]}), 400, "invalid_request")


def test_a_stored_byte_gone_wrong_fails_the_direct_load_typed(
    make_service: Callable[..., Service],
) -> None:
    service = make_service()
    with CheckpointClient(service.url) as client:
        client.save("bad", 1, {"w": torch.arange(50_000, dtype=torch.float32)})
    (blob,) = service.data_dir.rglob("*.blob")
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with (
        CheckpointClient(service.url, direct=True, retries=0) as client,
        pytest.raises(CorruptData),
    ):
        client.load("bad", 1)
