"""Malformed uploads that test_bad_input.py does not cover, against a real service.

Headers that are valid JSON but ambiguous (a name given twice), text that is not text (lone
surrogates spelled as JSON escapes, NUL in a tensor name: PostgreSQL text refuses both, SQLite
and the response encoder the first), sizes beyond int64, and metadata no client could load
back (an unknown format, a skeleton that is not one or refers to tensors that are not sent).
Each gets a 400 ``invalid_stream`` and leaves nothing; the valid edge cases next to them are
stored and come back byte for byte.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

import httpx
import pytest

from support.bodies import (
    W,
    assert_nothing_stored,
    chunked_upload,
    framed,
    skeleton,
    uploading,
    wait_consumed,
)
from support.serviceproc import Service
from support.waiting import eventually, wait_until

W_JSON = b'{"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}'
DATA = bytes(range(24))
META = {"format": "ckptstore/1", "skeleton": skeleton("w")}


def with_meta(**meta: str) -> bytes:
    return framed({"__metadata__": meta, "w": W}, DATA)


BAD = {
    # one name, two entries: which one is meant?
    "duplicate-name-same-entry": framed(b'{"w": ' + W_JSON + b', "w": ' + W_JSON + b"}", DATA),
    "duplicate-name-other-shape": framed(
        b'{"w": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}, "w": ' + W_JSON + b"}",
        DATA,
    ),
    "duplicate-metadata": framed(
        b'{"__metadata__": {"format": 1}, "__metadata__": {}, "w": ' + W_JSON + b"}", DATA
    ),
    "duplicate-key-in-entry": framed(
        b'{"w": {"dtype": "I32", "dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}', DATA
    ),
    # not text: a 500 (SQLite), a reset connection, or a checkpoint that never loads again
    "name-lone-surrogate": framed(b'{"w\\ud800": ' + W_JSON + b"}", DATA),
    "metadata-value-lone-surrogate": framed(
        b'{"__metadata__": {"note": "\\udc00"}, "w": ' + W_JSON + b"}", DATA
    ),
    "metadata-key-lone-surrogate": framed(
        b'{"__metadata__": {"\\udc00": ""}, "w": ' + W_JSON + b"}", DATA
    ),
    "name-nul": framed({"a\u0000b": W}, DATA),
    # sizes torch (int64) cannot hold, in tensors with no bytes
    "dim-2-70-of-empty": framed(
        {"w": {"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}}, b""
    ),
    "dim-2-63-of-empty": framed(
        {"w": {"dtype": "U8", "shape": [2**63, 0], "data_offsets": [0, 0]}}, b""
    ),
    # each dim fits, their product does not: torch cannot make even this empty tensor
    "dims-multiplying-past-2-63-of-empty": framed(
        {"w": {"dtype": "F32", "shape": [2**32, 2**32, 0], "data_offsets": [0, 0]}}, b""
    ),
    # metadata the client cannot load back
    "format-unknown": with_meta(format="ckptstore/99"),
    "skeleton-of-another-format": with_meta(format="pt", skeleton=skeleton("w")),
    "skeleton-not-json": with_meta(format="ckptstore/1", skeleton="garbage"),
    "skeleton-nan": with_meta(format="ckptstore/1", skeleton='{"v":1,"root":NaN}'),
    "skeleton-not-v1": with_meta(format="ckptstore/1", skeleton='{"w":"w"}'),
    "skeleton-version-2": with_meta(format="ckptstore/1", skeleton='{"v":2,"root":null}'),
    "skeleton-version-true": with_meta(format="ckptstore/1", skeleton='{"v":true,"root":null}'),
    "skeleton-missing-tensor": with_meta(format="ckptstore/1", skeleton=skeleton("w", "gone")),
    "skeleton-ndarray-missing-tensor": with_meta(
        format="ckptstore/1",
        skeleton='{"v":1,"root":{"t":"ndarray","d":"<f4","s":[6],"n":"x"}}',
    ),
    "skeleton-name-not-string": with_meta(
        format="ckptstore/1", skeleton='{"v":1,"root":{"t":"tensor","n":7}}'
    ),
}


@pytest.mark.parametrize("name", BAD)
def test_malformed_header_is_a_400_and_leaves_nothing(
    service: Service, http: httpx.Client, name: str
) -> None:
    run = f"hdr-{name}"
    response = http.post(f"/v1/runs/{run}/checkpoints/1", content=BAD[name])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_stream" and error["message"], error
    assert_nothing_stored(service, run)


GOOD = {
    # a tensor named twice by the skeleton is a tied tensor, sent once
    "skeleton-refers-twice": with_meta(
        format="ckptstore/1",
        skeleton='{"v":1,"root":[{"t":"tensor","n":"w"},{"t":"tensor","n":"w"}]}',
    ),
    "plain-safetensors": framed({"w": W}, DATA),
    "plain-safetensors-of-transformers": with_meta(format="pt"),
    "nul-in-metadata": with_meta(format="ckptstore/1", skeleton=skeleton("w"), note="a\u0000b"),
    "name-20-MiB": framed({"__metadata__": {}, "n" * (20 << 20): W}, DATA),
    "name-path-like": framed({"../../etc/passwd": W}, DATA),
    "empty-tensor-at-the-end": framed(
        {"w": W, "e": {"dtype": "F32", "shape": [0, 2**62], "data_offsets": [24, 24]}}, DATA
    ),
    "empty-tensor-of-large-dims": framed(
        {"w": W, "e": {"dtype": "F32", "shape": [2**31, 2**31, 0], "data_offsets": [24, 24]}},
        DATA,
    ),
}


@pytest.mark.parametrize("name", GOOD)
def test_valid_edge_cases_are_stored_exactly(http: httpx.Client, name: str) -> None:
    run = f"hdr-ok-{name}"
    body = GOOD[name]
    response = http.post(f"/v1/runs/{run}/checkpoints/1", content=body)
    assert response.status_code == 201, response.text
    got = http.get(f"/v1/runs/{run}/checkpoints/1")
    assert got.status_code == 200, got.text
    (n,) = struct.unpack("<Q", got.content[:8])
    assert got.content[8 + n :] == DATA


def test_chunked_upload_cut_mid_tensor_by_a_disconnect(
    service: Service, http: httpx.Client
) -> None:
    run = "hdr-chunked-cut"
    n = 6 << 20
    header = {"__metadata__": META, "w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}
    body = framed(header, os.urandom(n))
    sock = chunked_upload(
        service.url, run, [body[i : i + 65536] for i in range(0, n // 2, 65536)], False
    )
    wait_consumed(sock)  # the service has read all that was sent, and waits for the rest
    wait_until(lambda: run in uploading(service), what="the upload began")
    sock.close()

    def nothing_left() -> None:
        assert_nothing_stored(service, run)
        assert os.listdir(service.data_dir / "blobs" / ".tmp") == []

    eventually(nothing_left)
    response = http.post(f"/v1/runs/{run}/checkpoints/1", content=body)
    assert response.status_code == 201, response.text


@pytest.mark.parametrize("name", ["empty-tensor-at-the-end", "empty-tensor-of-large-dims"])
def test_stored_empty_tensors_of_large_dims_load_in_the_client(
    service: Service, http: httpx.Client, name: str
) -> None:
    """What the service takes, torch can make: the shapes it refuses are those torch
    cannot (``dims-multiplying-past-2-63-of-empty``), checked here the other way round."""
    import torch

    from ckptstore import CheckpointClient

    run = f"hdr-load-{name}"
    assert http.post(f"/v1/runs/{run}/checkpoints/1", content=GOOD[name]).status_code == 201
    loaded = CheckpointClient(service.url).load(run, 1)
    assert loaded["e"].numel() == 0 and loaded["e"].dtype == torch.float32
    with pytest.raises(RuntimeError, match="overflow"):
        torch.empty([2**32, 2**32, 0])


def test_a_header_declaring_too_many_tensors_is_a_413(
    make_service: Callable[..., Service],
) -> None:
    """Each declared tensor costs catalog rows, with bytes or without: one checkpoint or
    part holds at most ``CKPTSTORE_MAX_TENSORS`` (the issue's 10^6 empty tensors took 2 GB)."""
    svc = make_service({"CKPTSTORE_MAX_TENSORS": "1000"})

    def body(n: int) -> bytes:
        empty = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
        return framed({f"t{i}": empty for i in range(n)})

    with httpx.Client(base_url=svc.url, timeout=60) as http:
        for path in ("/v1/runs/many/checkpoints/1", "/v1/runs/many/checkpoints/2/parts/rank-0"):
            method = http.post if path.endswith("/1") else http.put
            answer = method(path, content=body(1001))
            assert answer.status_code == 413, answer.text
            assert answer.json()["error"]["code"] == "payload_too_large"
            assert "CKPTSTORE_MAX_TENSORS" in answer.json()["error"]["message"]
        assert_nothing_stored(svc, "many")
        assert http.post("/v1/runs/many/checkpoints/1", content=body(1000)).status_code == 201
