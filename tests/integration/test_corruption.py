"""Corrupt stored data is refused, never served: a flipped byte in a blob, a catalog whose
chunks no longer tile their tensor, a damaged base cache file."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointClient, CkptStoreError, CorruptData
from ckptstore_service.names import parse_blob_key
from support.serviceproc import Service, forget_cache

ENV = {"CKPTSTORE_CHUNK_BYTES": str(64 << 10)}  # several chunks per tensor


def _states() -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(512, 256, generator=g)
    return [{"w": w + 1e-3 * i * torch.randn(512, 256, generator=g), "step": i} for i in range(3)]


@pytest.fixture
def saved(
    make_service: Callable[..., Service], tmp_path: Path
) -> tuple[Path, list[dict[str, Any]]]:
    """A data folder holding a run of 3 checkpoints (one chain), and their states."""
    states = _states()
    data_dir = tmp_path / "data"
    svc = make_service(ENV, data_dir)
    with CheckpointClient(svc.url) as client:
        for i, state in enumerate(states):
            client.save("run", i, state)
    svc.stop()
    forget_cache(data_dir)
    return data_dir, states


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _client(svc: Service) -> CheckpointClient:
    return CheckpointClient(svc.url, retries=0)


@pytest.mark.slow
def test_a_flipped_byte_in_a_blob_is_refused(
    make_service: Callable[..., Service], saved: tuple[Path, list[dict[str, Any]]]
) -> None:
    data_dir, states = saved
    blobs = (data_dir / "blobs").rglob("*.blob")
    (blob,) = (p for p in blobs if step_of(p) == 1)  # the middle of the chain
    _flip(blob, blob.stat().st_size // 2)
    svc = make_service(ENV, data_dir)  # a fresh process: no base cache
    with _client(svc) as client:
        assert torch.equal(client.load("run", 0)["w"], states[0]["w"])  # its own blob: fine
        for step in (1, 2):  # the corrupt chunk, and the delta that rests on it
            with pytest.raises(CkptStoreError) as err:
                client.load("run", step)
            # refused before the response starts, or the response is cut short
            assert isinstance(err.value, CorruptData) or "cut its response short" in str(err.value)


@pytest.mark.slow
def test_chunks_that_do_not_tile_their_tensor_are_refused(
    make_service: Callable[..., Service], saved: tuple[Path, list[dict[str, Any]]]
) -> None:
    data_dir, _ = saved
    with sqlite3.connect(data_dir / "catalog.sqlite3") as db:
        (checkpoint,) = db.execute("SELECT id FROM checkpoints WHERE step = 1").fetchone()
        (chunk,) = db.execute(
            "SELECT max(id) FROM chunks WHERE checkpoint_id = ?", (checkpoint,)
        ).fetchone()
        db.execute("DELETE FROM chunks WHERE id = ?", (chunk,))  # a hole in the tensor
    svc = make_service(ENV, data_dir)
    with _client(svc) as client, pytest.raises(CorruptData, match="do not tile"):
        client.load("run", 1)


@pytest.mark.slow
def test_a_damaged_base_cache_is_refused(
    make_service: Callable[..., Service], saved: tuple[Path, list[dict[str, Any]]]
) -> None:
    data_dir, states = saved
    # nothing kept decoded in memory, which would serve the second load without the file
    svc = make_service({**ENV, "CKPTSTORE_DECODED_CACHE_BYTES": "0"}, data_dir)
    with _client(svc) as client:
        assert torch.equal(client.load("run")["w"], states[-1]["w"])  # decoded, then cached
        (cached,) = (data_dir / "cache").rglob("*.bin")
        _flip(cached, 1000)
        with pytest.raises(CorruptData, match="does not match its checksum"):
            client.load("run")


@pytest.fixture
def saved_big(make_service: Callable[..., Service], tmp_path: Path) -> Path:
    """A data folder holding one keyframe of 4.5 MiB in 64 KiB chunks, a byte flipped at
    3/4 of its blob: a chunk decoded well after the response has started."""
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(512, 256, generator=g)}
    data_dir = tmp_path / "data"
    svc = make_service(ENV, data_dir)
    with CheckpointClient(svc.url) as client:
        client.save("big", 0, state)
    svc.stop()
    forget_cache(data_dir)
    (blob,) = (data_dir / "blobs").rglob("*.blob")
    _flip(blob, blob.stat().st_size * 3 // 4)
    return data_dir


def test_corruption_found_mid_stream_is_corrupt_data(
    make_service: Callable[..., Service],
    saved_big: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A chunk that fails its checksum after the response has started: the client raises
    CorruptData at once (no retry), not the ServiceUnavailable of a service that failed
    while sending; the same for a DCP-style select and a pull to a file. The service
    completes the tensor it was sending (with filler that fails the checksum the response
    carries for it), then cuts the response."""
    from ckptstore import parts
    from ckptstore.files import pull_file, temporary_path

    svc = make_service(ENV, saved_big)  # a fresh process: no base cache
    with (
        CheckpointClient(svc.url, retries=2, backoff=0.05) as client,
        caplog.at_level("WARNING", logger="ckptstore"),
    ):
        with pytest.raises(CorruptData, match="checksum"):
            client.load("big", 0)
        with pytest.raises(CorruptData, match="checksum"):
            parts.select(client, "big", 0, ["w", "b"], lambda spec, data: None)
        out = tmp_path / "big.safetensors"
        with pytest.raises(CorruptData, match="checksum"):
            pull_file(client, "big", 0, out)
        assert not out.exists() and not temporary_path(out).exists()
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]
    log = svc.log.read_text()
    assert "does not match" in log or "checksum" in log, log[-2000:]


def step_of(blob: Path) -> int:
    """The step whose save wrote ``blob`` (its key's)."""
    key = parse_blob_key(f"runs/{blob.parent.name}/{blob.name}")
    assert key is not None, blob
    return key.step
