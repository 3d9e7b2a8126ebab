"""A checkpoint's user metadata (``save(..., metadata=...)``): kept with it, listed, part of
its content, checked on both sides of the wire."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from ckptstore import CheckpointClient, CheckpointExists
from ckptstore import parts as client_parts
from ckptstore_core.records import (
    MAX_USER_METADATA_BYTES,
    USER_METADATA_KEY,
    decode_user_metadata,
    encode_user_metadata,
)
from ckptstore_core.wire import FORMAT, encode_header
from support.bodies import assert_error
from support.serviceproc import Service


def _state(step: int) -> dict[str, object]:
    return {"w": torch.arange(64, dtype=torch.float32) + step, "step": step}


def test_metadata_is_listed_and_kept_with_the_checkpoint(service: Service) -> None:
    meta = {"eval_loss": 0.3125, "tags": ["best", "ünïcode"], "nested": {"epoch": 3}}
    with CheckpointClient(service.url) as client:
        saved = client.save("meta", 1, _state(1), metadata=meta)
        assert saved.metadata == meta
        client.save("meta", 2, _state(2))
        future = client.save_async("meta", 3, _state(3), metadata={"eval_loss": 0.25})
        assert future.result(timeout=60).metadata == {"eval_loss": 0.25}
        listed = {c.step: c.metadata for c in client.list("meta")}
        assert listed == {1: meta, 2: {}, 3: {"eval_loss": 0.25}}
        # part of the checkpoint: the same again is a retry, other metadata a conflict
        assert client.save("meta", 1, _state(1), metadata=meta).metadata == meta
        with pytest.raises(CheckpointExists):
            client.save("meta", 1, _state(1), metadata={"eval_loss": 0.5})
        assert client.load("meta", 1)["step"] == 1  # the state itself is untouched
    raw = httpx.get(f"{service.url}/v1/runs/meta/checkpoints", timeout=30).json()
    assert raw["checkpoints"][0]["metadata"] == meta


def test_a_commit_carries_metadata(service: Service) -> None:
    with CheckpointClient(service.url) as client:
        data = torch.ones(4).numpy().tobytes()
        client_parts.put_part(
            client, "meta-parts", 5, "rank-0", [("w", "F32", (4,))], [data].__iter__
        )
        user = encode_user_metadata({"eval_loss": 1.5})
        client_parts.commit(client, "meta-parts", 5, ["rank-0"], {USER_METADATA_KEY: user})
        assert client.list("meta-parts")[0].metadata == {"eval_loss": 1.5}


@pytest.mark.parametrize(
    ("metadata", "error"),
    [
        ({"loss": math.nan}, ValueError),
        ({"loss": math.inf}, ValueError),
        ({1: "int key"}, ValueError),
        ({"blob": "x" * MAX_USER_METADATA_BYTES}, ValueError),
        ({"obj": object()}, TypeError),
        (["not", "a", "mapping"], TypeError),
    ],
)
def test_the_client_refuses_metadata_that_is_no_small_json_object(
    service: Service, metadata: object, error: type[Exception]
) -> None:
    with CheckpointClient(service.url) as client:
        with pytest.raises(error):
            client.save("meta-bad", 1, _state(1), metadata=metadata)  # type: ignore[arg-type]
        failed = client.save_async("meta-bad", 1, _state(1), metadata=metadata)  # type: ignore[arg-type]
        with pytest.raises(error):
            failed.result(timeout=60)
    assert httpx.get(f"{service.url}/v1/runs/meta-bad/checkpoints").status_code == 404


@pytest.mark.parametrize("text", ["[1, 2]", "{bad json", '{"x": NaN}', "1" * (70 << 10)])
def test_the_service_refuses_metadata_that_is_no_small_json_object(
    service: Service, text: str
) -> None:
    prefix, _ = encode_header([("w", "U8", (1,))], {"format": FORMAT, USER_METADATA_KEY: text})
    answer = httpx.post(
        f"{service.url}/v1/runs/meta-raw/checkpoints/1", content=prefix + b"\0", timeout=30
    )
    assert_error(answer, 400, "invalid_stream")
    assert USER_METADATA_KEY in answer.json()["error"]["message"]
    with pytest.raises(ValueError):
        decode_user_metadata(text)
    commit = httpx.post(
        f"{service.url}/v1/runs/meta-raw/checkpoints/1/commit",
        json={"parts": ["rank-0"], "metadata": {USER_METADATA_KEY: text}},
        timeout=30,
    )
    assert commit.status_code == 400
    assert httpx.get(f"{service.url}/v1/runs/meta-raw/checkpoints").status_code == 404
