"""The core's chunk pipeline run on its own, as a client that encodes its own chunks runs it:
no service, no catalog, an in-memory :class:`ChunkSink`; what it stores decodes back to the
exact bytes, and the second checkpoint is stored as deltas against the first."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ckptstore_core import codec
from ckptstore_core.pipeline import (
    Budget,
    Buffer,
    ChunkInfo,
    ChunkPipeline,
    DeltaPlanner,
    FileBases,
    Stored,
)
from ckptstore_core.wire import FORMAT, Header, TensorPiece, encode_header

CHUNK = 64 << 10


class MemorySink:
    """A blob in memory: the smallest :class:`ChunkSink`."""

    def __init__(self) -> None:
        self.blob = bytearray()
        self.calls = 0

    def write(self, parts: Iterable[Buffer]) -> tuple[int, int]:
        self.calls += 1
        offset = len(self.blob)
        for part in parts:
            self.blob += part
        return offset, len(self.blob) - offset


def pieces_of(header: Header, arrays: list[np.ndarray], piece: int) -> Iterator[TensorPiece]:
    for i, a in enumerate(arrays):
        raw = memoryview(a.tobytes())
        for off in range(0, header.tensors[i].nbytes, piece):
            yield TensorPiece(i, off, raw[off : off + piece])


def committed(stored: Stored, first_id: int) -> list[ChunkInfo]:
    """The rows as a catalog would return them: ids from ``first_id``."""
    return [
        ChunkInfo(
            **{f: getattr(c, f) for f in c.__dataclass_fields__},
            id=first_id + k,
            blob_key="b",
            checkpoint_id=1,
        )
        for k, c in enumerate(stored.chunks)
    ]


def decoded(rows: list[ChunkInfo], blob: bytes, raws: dict[int, bytes]) -> dict[int, bytes]:
    """Each chunk's bytes by id, decoded from ``blob``; ``raws`` holds the bases' bytes."""
    out = {}
    for c in rows:
        payload = blob[c.blob_offset : c.blob_offset + c.stored_len]
        if c.codec == codec.REF:
            assert c.base_id is not None
            data = raws[c.base_id]
        else:
            links: list[tuple[str, Buffer]] = [(c.codec, payload)]
            if c.base_id is not None:
                links.insert(0, (codec.RAW, raws[c.base_id]))
            data = bytes(codec.decode_chain(links, c.itemsize, c.raw_len, c.checksum))
        out[c.id] = data
    return out


def tensor_bytes(rows: list[ChunkInfo], chunks: dict[int, bytes], idx: int) -> bytes:
    return b"".join(
        chunks[c.id] for c in sorted(rows, key=lambda c: c.offset) if c.tensor_idx == idx
    )


def test_two_checkpoints_round_trip_through_a_memory_sink() -> None:
    rng = np.random.default_rng(0)
    specs = [("w", "F32", (300, 200)), ("step", "I64", (4,)), ("ids", "I32", (70_000,))]
    w = rng.standard_normal((300, 200)).astype(np.float32)
    first = [w, np.arange(4, dtype=np.int64), rng.integers(0, 9, 70_000).astype(np.int32)]
    # the next step: weights nudged, counters moved, ids unchanged
    nudge = np.float32(1e-4) * rng.standard_normal(w.shape).astype(np.float32)
    second = [w + nudge, first[1] + 1, first[2].copy()]
    header = encode_header(specs, {"format": FORMAT})[1]
    pipeline = ChunkPipeline(ThreadPoolExecutor(2), Budget(2, CHUNK), CHUNK, 1)

    with tempfile.TemporaryFile() as f1, tempfile.TemporaryFile() as f2:
        sink1 = MemorySink()
        planner1 = DeltaPlanner(header, keyframe=True, since_keyframe=0, max_chain_depth=0)
        s1 = pipeline.run(
            header, pieces_of(header, first, 10_000), planner1, None, f1.fileno(), sink1
        )
        rows1 = committed(s1, 1)
        chunks1 = decoded(rows1, bytes(sink1.blob), {})
        tensors = {t.idx: t for t in s1.tensors}
        planner2 = DeltaPlanner(
            header, keyframe=False, since_keyframe=1, max_chain_depth=8,
            parent_tensors=tensors, parent_chunks=rows1,
        )  # fmt: skip
        sink2 = MemorySink()
        bases = FileBases(f1.fileno())
        s2 = pipeline.run(
            header, pieces_of(header, second, 7_777), planner2, bases, f2.fileno(), sink2
        )
        rows2 = committed(s2, 1000)
        chunks2 = decoded(rows2, bytes(sink2.blob), chunks1)
        cache2 = f2.read()

    for i, a in enumerate(first):
        assert tensor_bytes(rows1, chunks1, i) == a.tobytes()
    for i, a in enumerate(second):
        assert tensor_bytes(rows2, chunks2, i) == a.tobytes()
        assert s2.tensors[i].checksum == codec.checksum(a.tobytes())
    # the raw file holds what the checkpoint loads to, at its data-section offsets
    assert cache2 == b"".join(a.tobytes() for a in second)
    # one write per chunk, in order; the unchanged tensor is a ref, the nudged one mostly
    # deltas (the codec keeps a delta only where it pays)
    assert sink2.calls == len(s2.chunks)
    ids = [c for c in rows2 if c.tensor_idx == 2]
    assert ids and all(c.codec == codec.REF and c.base_id is not None for c in ids)
    weights = [c for c in rows2 if c.tensor_idx == 0]
    assert sum(codec.is_delta(c.codec) and c.depth == 1 for c in weights) >= 3
    assert len(sink2.blob) < len(sink1.blob)


def test_the_pipeline_imports_neither_torch_nor_the_service() -> None:
    code = "import sys, ckptstore_core.pipeline; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = {m.split(".")[0] for m in out.stdout.split()}
    assert "torch" not in loaded
    assert "ckptstore_service" not in loaded
    assert "ckptstore" not in loaded
