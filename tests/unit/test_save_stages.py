"""The save path's stages, each on its own: splitter, delta planner, encode pipeline, upload
transaction (no HTTP; a real SQLite catalog and local blob folder where one is needed)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
import xxhash

from ckptstore_core import codec
from ckptstore_core.errors import StorageUnavailable
from ckptstore_core.pipeline import (
    Budget,
    ChunkInfo,
    ChunkPlan,
    DeltaPlanner,
    EncodePipeline,
    NewChunk,
    RawChunk,
    Splitter,
    TensorInfo,
    same_offsets,
)
from ckptstore_core.pipeline.plan import cast_sources
from ckptstore_core.wire import FORMAT, Header, TensorPiece, encode_header
from ckptstore_service.catalog import Catalog
from ckptstore_service.save.upload import UploadTransaction
from ckptstore_service.storage import open_blob_store

CHUNK = 64 << 10  # the smallest chunk size the settings allow


def header_of(*tensors: tuple[str, str, tuple[int, ...]]) -> Header:
    return encode_header(list(tensors), {"format": FORMAT})[1]


def pieces(header: Header, data: list[bytes], size: int) -> list[TensorPiece]:
    """The tensors' bytes cut into pieces of ``size`` (as a body arrives)."""
    out = []
    for i, raw in enumerate(data):
        for off in range(0, len(raw), size):
            out.append(TensorPiece(i, off, memoryview(raw[off : off + size])))
    return out


# -- splitter -------------------------------------------------------------------------------


@pytest.mark.parametrize("piece_size", [1000, 4096, 1 << 20])
def test_chunks_tile_each_tensor_at_fixed_offsets_whatever_the_pieces(piece_size: int) -> None:
    header = header_of(("a", "F32", (40_000,)), ("b", "I64", (3,)), ("c", "BF16", (70_001,)))
    rng = np.random.default_rng(0)
    data = [rng.bytes(t.nbytes) for t in header.tensors]
    splitter = Splitter(header, CHUNK)
    seen: dict[int, list[tuple[int, bytes]]] = {}
    for c in splitter.chunks(pieces(header, data, piece_size)):
        assert c.offset % codec.chunk_step(c.itemsize, CHUNK) == 0
        assert c.file_offset == header.tensors[c.tensor_idx].begin + c.offset
        seen.setdefault(c.tensor_idx, []).append((c.offset, bytes(c.data)))
        splitter.digests.chunk_checksum(c.tensor_idx, xxhash.xxh3_128_digest(bytes(c.data)))
        splitter.recycle(c.block)
    for i, raw in enumerate(data):
        assert b"".join(d for _, d in seen[i]) == raw
        assert [o for o, _ in seen[i]] == sorted(o for o, _ in seen[i])
    for i, t in enumerate(header.tensors):
        assert len(seen[i]) == -(-t.nbytes // codec.chunk_step(t.itemsize, CHUNK))
    assert len(seen[0]) == 3 and len(seen[1]) == 1
    assert splitter.digests.finish() == [xxhash.xxh3_128_digest(raw) for raw in data]


def test_blocks_are_recycled() -> None:
    header = header_of(("a", "F32", (100_000,)))
    data = [bytes(header.tensors[0].nbytes)]
    splitter = Splitter(header, CHUNK)
    blocks = []
    for c in splitter.chunks(pieces(header, data, 1 << 20)):
        blocks.append(id(c.block))
        splitter.recycle(c.block)
    assert len(blocks) == 7 and len(set(blocks)) == 1


def test_a_tensor_of_one_chunk_without_its_checksum_is_an_internal_error() -> None:
    header = header_of(("a", "F32", (10,)))
    splitter = Splitter(header, CHUNK)
    list(splitter.chunks(pieces(header, [bytes(40)], 40)))
    with pytest.raises(Exception, match="got no chunk checksum"):
        splitter.digests.finish()


# -- delta planner --------------------------------------------------------------------------


def parent_of(header: Header, depth: int = 0) -> tuple[dict[int, TensorInfo], list[ChunkInfo]]:
    """A parent that stored each tensor of ``header`` as chunks of CHUNK, ``depth`` deep."""
    tensors, chunks = {}, []
    for i, t in enumerate(header.tensors):
        tensors[i] = TensorInfo(i, t.name, t.dtype, t.shape, t.begin, t.nbytes, b"\0" * 16)
        step = codec.chunk_step(t.itemsize, CHUNK)
        for off in range(0, t.nbytes, step):
            n = min(step, t.nbytes - off)
            fields = (i, off, n, t.itemsize, "raw", None, depth, 0, n, b"\0" * 16)
            chunks.append(ChunkInfo(*fields, id=100 + len(chunks), blob_key="k", checkpoint_id=1))
    return tensors, chunks


def raw_chunks(header: Header) -> list[RawChunk]:
    data = [bytes(t.nbytes) for t in header.tensors]
    return list(Splitter(header, CHUNK).chunks(pieces(header, data, 1 << 30)))


def test_each_chunk_gets_the_same_place_in_the_parent_as_its_base() -> None:
    header = header_of(("w", "F32", (20_000,)), ("new", "F32", (10,)))
    tensors, chunks = parent_of(header_of(("w", "F32", (20_000,))), depth=2)
    planner = DeltaPlanner(
        header,
        keyframe=False,
        since_keyframe=1,
        max_chain_depth=8,
        parent_tensors=tensors,
        parent_chunks=chunks,
    )
    plans = [planner.plan(c) for c in raw_chunks(header)]
    assert [p.base.chunk_id if p.base else None for p in plans] == [100, 101, None]
    assert [p.delta for p in plans] == [True, True, False]
    assert plans[1].base is not None and plans[1].base.file_offset == 65536


def test_no_delta_on_a_keyframe_or_past_the_chain_depth() -> None:
    header = header_of(("w", "F32", (100,)))
    for keyframe, depth in ((True, 0), (False, 8)):
        tensors, chunks = parent_of(header, depth=depth)
        planner = DeltaPlanner(
            header,
            keyframe=keyframe,
            since_keyframe=0,
            max_chain_depth=8,
            parent_tensors=tensors,
            parent_chunks=chunks,
        )
        (plan,) = [planner.plan(c) for c in raw_chunks(header)]
        assert plan.base is not None and not plan.delta  # a ref to the base stays allowed


def test_links_count_deltas_and_siblings() -> None:
    header = header_of(("master/w", "F32", (100,)), ("model/w", "BF16", (100,)))
    assert cast_sources(header) == {1: 0}
    tensors, chunks = parent_of(header, depth=3)
    planner = DeltaPlanner(
        header,
        keyframe=False,
        since_keyframe=1,
        max_chain_depth=8,
        parent_tensors=tensors,
        parent_chunks=chunks,
    )
    master, copy = raw_chunks(header)
    master_plan = planner.plan(master)
    copy_plan = planner.plan(copy)
    assert master_plan.written is not None and copy_plan.cast is not None
    assert copy_plan.cast.written is master_plan.written
    delta = planner.link(master, master_plan, "sub/1|zstd/1")
    assert (delta.base_id, delta.depth, delta.sibling) == (100, 4, None)
    cast = codec.CASTS["BF16"] + "|" + codec.REF
    sibling = planner.link(copy, copy_plan, cast)
    assert (sibling.base_id, sibling.depth, sibling.sibling) == (None, 5, 0)


def test_same_offsets() -> None:
    header = header_of(("a", "F32", (10,)), ("b", "F32", (10,)))
    tensors, _ = parent_of(header)
    assert same_offsets(tensors.values(), header)
    moved = header_of(("b", "F32", (10,)), ("a", "F32", (10,)))
    assert not same_offsets(tensors.values(), moved)


# -- encode pipeline ------------------------------------------------------------------------


class CountingPool(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(2)
        self.outstanding = self.most = 0
        self._lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        with self._lock:
            self.outstanding += 1
            self.most = max(self.most, self.outstanding)
        future: Future[object] = super().submit(fn, *args, **kwargs)
        return future

    def taken(self) -> None:
        with self._lock:
            self.outstanding -= 1


def test_the_pipeline_keeps_order_and_its_budget(tmp_path: Path) -> None:
    header = header_of(*((f"t{i}", "F32", (40_000,)) for i in range(6)), ("small", "I64", (5,)))
    rng = np.random.default_rng(1)
    data = [rng.bytes(t.nbytes) for t in header.tensors]
    splitter = Splitter(header, CHUNK)
    plan = ChunkPlan(None, False, None, None)
    budget = Budget(workers=1, chunk_bytes=CHUNK)  # 4 chunks in flight at most
    cache = tmp_path / "cache"
    fd = open_rw(cache)
    with CountingPool() as pool, EncodePipeline(pool, budget, 1, None, fd, splitter.recycle) as p:
        planned = ((c, plan) for c in splitter.chunks(pieces(header, data, 1 << 20)))
        out = []
        for e in p.run(planned):
            if len(e.chunk.data) >= 64 << 10:
                pool.taken()
            out.append(e)
        assert pool.most <= budget.in_flight + 1
    order = [(e.chunk.tensor_idx, e.chunk.offset) for e in out]
    assert order == sorted(order) and len(order) == 6 * 3 + 1
    for e in out:  # each decodes to its bytes, and the cache file holds them all
        raw = data[e.chunk.tensor_idx][e.chunk.offset : e.chunk.offset + e.chunk.raw_len]
        assert (
            codec.decode_chunk(
                e.enc.codec, e.enc.payload, None, e.chunk.itemsize, len(raw), e.enc.checksum
            )
            == raw
        )
    assert cache.read_bytes() == b"".join(data)


def test_a_failing_job_stops_the_pipeline_and_waits_for_the_others(tmp_path: Path) -> None:
    header = header_of(*((f"t{i}", "F32", (40_000,)) for i in range(4)))
    splitter = Splitter(header, CHUNK)
    plan = ChunkPlan(None, False, None, None)
    fd = open_rw(tmp_path / "cache")
    import os

    os.close(fd)  # every job's write to the cache file fails
    with (
        ThreadPoolExecutor(2) as pool,
        pytest.raises(OSError),
        EncodePipeline(pool, Budget(1, CHUNK), 1, None, fd, splitter.recycle) as p,
    ):
        data = [bytes(t.nbytes) for t in header.tensors]
        list(p.run((c, plan) for c in splitter.chunks(pieces(header, data, 1 << 20))))


def open_rw(path: Path) -> int:
    import os

    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


# -- upload transaction ---------------------------------------------------------------------


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    cat = Catalog(f"sqlite:///{tmp_path / 'c.sqlite3'}")
    cat.upgrade()
    return cat


def test_commit_makes_the_checkpoint_visible(tmp_path: Path, catalog: Catalog) -> None:
    store = open_blob_store(str(tmp_path / "blobs"))
    with UploadTransaction.begin(catalog, store, "r", 5) as tx:
        assert catalog.find("r", 5) is None  # writing: not visible
        offset, size = tx.write([b"abc", b"defg"])
        assert (offset, size) == (0, 7)
        assert tx.finish() == 7
        chunk = NewChunk(0, 0, 7, 1, codec.RAW, None, 0, 0, 7, xxhash.xxh3_128_digest(b""))
        tx.commit(
            parent_id=None,
            keyframe=True,
            since_keyframe=0,
            raw_bytes=7,
            stored_bytes=7,
            metadata={},
            tensors=[TensorInfo(0, "t", "U8", (7,), 0, 7, b"\0" * 16)],
            chunks=[chunk],
            sibling_bases={},
        )
    info = catalog.get("r", 5)
    assert info.stored_bytes == 7 and info.keyframe
    assert store.get(info.blob_key) == b"abcdefg"
    assert catalog.uploads_in_progress() == []


def test_a_failure_deletes_the_blob_then_its_row(tmp_path: Path, catalog: Catalog) -> None:
    store = open_blob_store(str(tmp_path / "blobs"))
    with pytest.raises(RuntimeError), UploadTransaction.begin(catalog, store, "r", 5) as tx:
        tx.write([b"abc"])
        tx.finish()
        raise RuntimeError("the commit never came")
    assert list(store.iter_keys()) == [] and catalog.uploads_in_progress() == []
    assert catalog.find("r", 5) is None


def test_a_blob_the_store_keeps_keeps_its_row(
    tmp_path: Path, catalog: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_blob_store(str(tmp_path / "blobs"))

    def refuse(key: str) -> None:
        raise StorageUnavailable("refused")

    monkeypatch.setattr(store, "delete", refuse)
    with pytest.raises(RuntimeError), UploadTransaction.begin(catalog, store, "r", 5) as tx:
        tx.write([b"abc"])
        tx.finish()
        raise RuntimeError("the commit never came")
    (row,) = catalog.uploads_in_progress()  # names the blob for the start-up collection
    assert [row[2]] == list(store.iter_keys())
    assert row[3] <= datetime.now(UTC)
