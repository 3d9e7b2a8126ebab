"""A checkpoint loaded again from chunks kept decoded skips the catalog's chunk tree
(``LoadedChunks``): only for the same tensors with the same checksums, and only while every
chunk it streamed from is still kept."""

from __future__ import annotations

import os

from ckptstore_core import codec
from ckptstore_core.chain import DecodedChunks
from ckptstore_core.pipeline.rows import ChunkInfo, TensorInfo
from ckptstore_service.chains import LoadedChunks


def chunk(i: int, data: bytes) -> ChunkInfo:
    return ChunkInfo(
        tensor_idx=i,
        offset=0,
        raw_len=len(data),
        itemsize=1,
        codec=codec.RAW,
        base_id=None,
        depth=0,
        blob_offset=0,
        stored_len=len(data),
        checksum=codec.checksum(data),
        id=100 + i,
        blob_key="b",
        checkpoint_id=7,
    )


def tensor(i: int, data: bytes) -> TensorInfo:
    return TensorInfo(i, f"t{i}", "U8", (len(data),), 0, len(data), codec.checksum(data))


DATA = [os.urandom(1000), os.urandom(300)]
CHUNKS = [chunk(i, d) for i, d in enumerate(DATA)]
TENSORS = [tensor(i, d) for i, d in enumerate(DATA)]


def kept_all(budget: int = 1 << 20) -> DecodedChunks:
    decoded = DecodedChunks(budget)
    for c, d in zip(CHUNKS, DATA, strict=True):
        decoded.put(c, d)
    return decoded


def test_a_load_remembered_is_served_from_the_kept_chunks_in_order() -> None:
    loaded, decoded = LoadedChunks(), kept_all()
    assert loaded.kept(7, TENSORS, decoded) is None  # nothing remembered yet
    loaded.remember(7, TENSORS, CHUNKS)
    assert loaded.kept(7, TENSORS, decoded) == CHUNKS
    assert [bytes(decoded.get(c) or b"") for c in CHUNKS] == DATA
    assert loaded.kept(8, TENSORS, decoded) is None  # another checkpoint


def test_other_tensors_or_checksums_are_not_served() -> None:
    loaded, decoded = LoadedChunks(), kept_all()
    loaded.remember(7, TENSORS, CHUNKS)
    assert loaded.kept(7, TENSORS[:1], decoded) is None  # a prefix of it
    rewritten = [TENSORS[0], tensor(1, os.urandom(300))]  # a tensor re-encoded lossy
    assert loaded.kept(7, rewritten, decoded) is None
    loaded.remember(7, TENSORS[:1], CHUNKS[:1])  # the prefix too: both are kept
    assert loaded.kept(7, TENSORS[:1], decoded) == CHUNKS[:1]
    assert loaded.kept(7, TENSORS, decoded) == CHUNKS


def test_a_chunk_no_longer_kept_or_kept_with_other_bytes_is_not_served() -> None:
    loaded = LoadedChunks()
    loaded.remember(7, TENSORS, CHUNKS)
    decoded = DecodedChunks(1 << 20)
    decoded.put(CHUNKS[0], DATA[0])  # the second was evicted
    assert loaded.kept(7, TENSORS, decoded) is None
    other = os.urandom(300)
    decoded.put(chunk(1, other), other)  # its id, another chunk's bytes (an id reused)
    assert loaded.kept(7, TENSORS, decoded) is None
    # looking left the entries as they were: the other chunk's bytes are still kept
    assert bytes(decoded.get(chunk(1, other)) or b"") == other


def test_the_entries_are_bounded_the_least_recently_remembered_out_first() -> None:
    loaded, decoded = LoadedChunks(entries=2), kept_all()
    for checkpoint_id in (1, 2, 3):
        loaded.remember(checkpoint_id, TENSORS, CHUNKS)
    assert loaded.kept(1, TENSORS, decoded) is None
    assert loaded.kept(2, TENSORS, decoded) == CHUNKS
    assert loaded.kept(3, TENSORS, decoded) == CHUNKS
