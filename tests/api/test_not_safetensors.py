"""A body of another format is refused as such: 400 invalid_stream, not 413 (issue 18, step 7).

Read as safetensors, a ``torch.save`` file's first 8 bytes ("PK\\x03\\x04..." of its zip) give a
header length of 578712552184433488 bytes; the service answered 413 "header length ...
exceeds the limit", which sent users looking for a size setting. The real ``torch.save``
output is posted here to a real service (uvicorn) over raw HTTP.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest
import torch

if TYPE_CHECKING:  # the fixture ``service`` is the conftest's
    from support.serviceproc import Service

STATE = {"model": {"w": torch.arange(64, dtype=torch.float32)}, "step": 7}


def torch_save(**options: bool) -> bytes:
    buf = io.BytesIO()
    torch.save(STATE, buf, **options)
    return buf.getvalue()


BODIES = {
    "torch-save": (torch_save(), "a torch.save file (a zip archive)"),
    "torch-save-legacy": (
        torch_save(_use_new_zipfile_serialization=False),
        "a pickle (protocol 2)",
    ),
    "pickle": (pickle.dumps({"w": [1.0] * 64}, protocol=5), "a pickle (protocol 5)"),
}


@pytest.fixture(scope="module")
def http(service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, timeout=30) as client:
        yield client


@pytest.mark.parametrize("name", BODIES)
def test_other_formats_are_invalid_stream(service: Service, http: httpx.Client, name: str) -> None:
    body, what = BODIES[name]
    run = f"foreign-{name}"
    response = http.post(f"/v1/runs/{run}/checkpoints/1", content=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_stream", error
    message = error["message"]
    assert message.startswith(f"the body is not a safetensors stream: it looks like {what}")
    assert "; ckptstore takes safetensors streams" in message
    assert "CheckpointClient.save" in message
    assert service.healthy()
    assert run not in [r["name"] for r in http.get("/v1/runs").json()["runs"]]


def test_torch_save_read_as_a_length_is_absurd() -> None:
    """What made the old answer a 413: the zip's first 8 bytes as a header length."""
    (length,) = struct.unpack("<Q", torch_save()[:8])
    assert length == 578712552184433488


def test_a_genuine_header_over_the_limit_is_still_413(http: httpx.Client) -> None:
    body = struct.pack("<Q", (100 << 20) + 8) + b'{"w": {"dtype": "F32", '
    response = http.post("/v1/runs/long-header/checkpoints/1", content=body)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "payload_too_large"


def test_a_multipart_form_says_to_send_the_raw_body(service: Service, http: httpx.Client) -> None:
    """``curl -F file=@model.safetensors``: a multipart/form-data body (httpx builds the same
    here) around a valid stream. It answered 413 "header length 3255307777713450285"."""
    from ckptstore_core.wire import encode_header

    stream, _ = encode_header([], {"format": "ckptstore/1", "skeleton": '{"v": 1, "root": {}}'})
    response = http.post(
        "/v1/runs/multipart/checkpoints/1", files={"file": ("model.safetensors", stream)}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_stream", error
    assert "multipart form upload" in error["message"]
    assert "--data-binary @model.safetensors" in error["message"]
    assert "multipart" not in [r["name"] for r in http.get("/v1/runs").json()["runs"]]
