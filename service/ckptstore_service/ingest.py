"""Save path: stream -> parse -> delta -> compress -> blob -> commit.

:func:`ingest` runs in a worker thread and consumes the request body as an iterator of byte
pieces (fed by the event loop, see ``api/body.py``). It holds a bounded amount whatever the
checkpoint's size: a few chunks in the codec pool, and small chunks it encoded itself up to a
byte budget. The body is parsed as it arrives, each full chunk is handed to the codec pool with
the location of its base in the parent's cached data, encoded chunks are appended in
order to the checkpoint's blob by a writer thread, and the raw bytes are written to a new base
cache file. After the last byte the blob is finished (durable) and one transaction commits the
checkpoint. Any failure aborts the blob, discards the cache file and deletes the ``writing``
row, so nothing becomes visible.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ckptstore_core import codec
from ckptstore_core.errors import CheckpointExists, InternalError, InvalidStream
from ckptstore_core.wire import FORMAT, Header, StreamParser, TensorPiece
from ckptstore_service.cache import open_reader
from ckptstore_service.catalog import CheckpointRecord, NewChunk, TensorInfo
from ckptstore_service.names import blob_key
from ckptstore_service.restore import materialize
from ckptstore_service.runtime import Runtime
from ckptstore_service.storage import BlobStore, Buffer

__all__ = ["ingest", "unbatched"]

_END = object()
# chunks smaller than this are encoded by the ingest thread itself: a hand-off to a codec
# thread (two wake-ups) costs more than encoding a few KiB
_INLINE_BYTES = 64 << 10
# what a small chunk waiting to be written counts for, at least, against the ingest's budget
_SMALL_COST = 16 << 10

log = logging.getLogger("ckptstore")


def read_header(parser: StreamParser, body: Iterator[bytes]) -> tuple[Header, list[TensorPiece]]:
    """Feed ``body`` until the header is parsed; returns it with any tensor pieces after it."""
    for data in body:
        events = list(parser.feed(data))
        if events:
            header = events[0]
            assert isinstance(header, Header)
            pieces = [e for e in events[1:] if isinstance(e, TensorPiece)]
            # copy: the pieces view ``data``, which the caller does not keep alive
            return header, [
                TensorPiece(p.index, p.offset, memoryview(bytes(p.data))) for p in pieces
            ]
    parser.close()  # raises: the stream ended inside the header
    raise AssertionError("unreachable")


def _check_metadata(header: Header) -> None:
    """Refuse a header whose checkpoint no client could load back (InvalidStream).

    The service does not interpret the skeleton (its tags belong to the client's state
    module), but it checks what it can without torch: no NUL in a tensor name, a
    ``ckptstore/`` format it knows (a skeleton comes with ours only), a skeleton that is JSON
    ``{"v": 1, "root": ...}``, and every tensor the skeleton refers to (``{"t": "tensor",
    "n": NAME}``, or an ``ndarray`` sent as a tensor) present in the header. A plain
    safetensors file has neither key and is stored as it is.
    """
    for t in header.tensors:
        # here, not in the wire parser the client shares: checkpoints stored on SQLite by
        # clients that sent NUL still download
        if "\x00" in t.name:
            raise InvalidStream(f"tensor name {t.name!r} holds NUL, which PostgreSQL refuses")
    meta = header.metadata
    fmt = meta.get("format", "")
    # other writers' formats ({"format": "pt"} from transformers) are plain safetensors files
    if fmt != FORMAT and (fmt.startswith("ckptstore/") or "skeleton" in meta):
        raise InvalidStream(f"unknown format {fmt!r}; this service stores {FORMAT!r}")
    skeleton = meta.get("skeleton")
    if skeleton is None:
        return
    try:
        doc = json.loads(skeleton, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise InvalidStream(f"skeleton is not JSON: {exc}") from exc
    version = doc.get("v") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or set(doc) != {"v", "root"}
        or type(version) is not int
        or version != 1
    ):
        raise InvalidStream('skeleton must be {"v": 1, "root": ...}')
    names = {t.name for t in header.tensors}
    todo: list[object] = [doc["root"]]
    while todo:  # iterative: the JSON parser allowed the nesting, so must this
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            if node.get("t") in ("tensor", "ndarray") and "n" in node:
                name = node["n"]
                if not isinstance(name, str) or name not in names:
                    raise InvalidStream(f"skeleton refers to tensor {name!r}, which is not sent")
            todo.extend(node.values())


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


@dataclass(frozen=True, slots=True)
class _BaseChunk:
    chunk_id: int  # a non-ref chunk (refs point straight at what they equal)
    depth: int
    file_offset: int  # of the chunk's raw bytes in the base cache file


def _base_index(
    rt: Runtime, parent: CheckpointRecord, tensors: dict[int, TensorInfo]
) -> dict[tuple[str, str, tuple[int, ...], int, int], _BaseChunk]:
    """Where each chunk of the parent (``tensors``: its tensors by index) lives: keyed by
    (name, dtype, shape, offset, length)."""
    index = {}
    for c in rt.catalog.chunks(parent.id):
        t = tensors[c.tensor_idx]
        target = c.base_id if c.codec == codec.REF else c.id
        assert target is not None
        index[(t.name, t.dtype, t.shape, c.offset, c.raw_len)] = _BaseChunk(
            target, c.depth, t.begin + c.offset
        )
    return index


def _same_offsets(parent: Iterable[TensorInfo], header: Header) -> bool:
    """Whether every tensor of ``header`` that the parent also has (same name, dtype and
    shape) lies at the same offset in both data sections. Then each chunk's base sits where
    the chunk itself goes: a save can overwrite its base file in place, each chunk right
    after reading its base, and nothing it still has to read is overwritten first."""
    begins = {(t.name, t.dtype, t.shape): t.begin for t in parent}
    return all(begins.get((t.name, t.dtype, t.shape), t.begin) == t.begin for t in header.tensors)


def unbatched(items: Iterable[object], end: object) -> Iterator[Any]:
    """The pieces of a batched hand-off between threads: each item is a list of pieces (of
    the caller's type), an exception (raised here) or ``end``."""
    for item in items:
        if item is end:
            return
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, list)
        yield from item


class _BlobWriter:
    """Runs ``store.put_stream`` in its own thread, fed through a bounded queue.

    Payloads are handed over in batches of ~1 MiB: a checkpoint has hundreds of small chunks,
    and each hand-off wakes the writer thread.
    """

    _BATCH = 1 << 20

    def __init__(self, store: BlobStore, key: str) -> None:
        self._q: queue.Queue[object] = queue.Queue(4)
        self._result: int | BaseException | None = None
        self._batch: list[Buffer] = []
        self._batched = 0
        self._thread = threading.Thread(target=self._run, args=(store, key), daemon=True)
        self._thread.start()

    def _pieces(self) -> Iterator[bytes]:
        return unbatched(iter(self._q.get, None), _END)  # get() until _END (never None)

    def _run(self, store: BlobStore, key: str) -> None:
        try:
            self._result = store.put_stream(key, self._pieces())
        except BaseException as exc:
            self._result = exc

    def _put(self, item: object) -> None:
        while self._thread.is_alive():
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        self._raise()

    def _raise(self) -> None:
        if isinstance(self._result, BaseException):
            raise self._result

    def write(self, data: Buffer) -> None:
        if len(data):
            self._batch.append(data)
            self._batched += len(data)
            if self._batched >= self._BATCH:
                self._flush()

    def _flush(self) -> None:
        if self._batch:
            self._put(self._batch)
            self._batch, self._batched = [], 0

    def finish(self) -> int:
        self._flush()
        self._put(_END)
        self._thread.join()
        self._raise()
        assert isinstance(self._result, int)
        return self._result

    def abort(self) -> None:
        if self._thread.is_alive():
            self._put(InvalidStream("upload aborted"))
            self._thread.join()


@dataclass(frozen=True, slots=True)
class _Pending:
    tensor_idx: int
    offset: int
    raw_len: int
    itemsize: int
    base: _BaseChunk | None
    cast: _CastFrom | None
    block: np.ndarray | None  # the recycled buffer that holds the raw chunk (None: encoded)
    future: Future[codec.EncodedChunk]


def _rebuild_base(rt: Runtime, run: str, parent: CheckpointRecord) -> int:
    """Decode the parent from storage into a cache file (a base-cache miss); returns its fd.

    The file is installed in the cache only if the parent is still the run's latest; the fd
    stays readable either way.
    """
    tmp = rt.cache.new_file(run)
    try:
        materialize(rt, parent, tmp)
        fd = open_reader(tmp)
    except BaseException:
        rt.cache.discard(tmp)
        raise
    _install_if_latest(rt, run, parent.id, tmp, parent.raw_bytes)
    return fd


def _install_if_latest(rt: Runtime, run: str, checkpoint_id: int, tmp: Path, size: int) -> None:
    """Make ``tmp`` the run's cached base if ``checkpoint_id`` is still its latest (a newer
    save may have committed meanwhile), else drop it."""
    latest = rt.catalog.find(run, None)
    if latest is not None and latest.id == checkpoint_id:
        rt.cache.install(run, checkpoint_id, tmp, size)
    else:
        rt.cache.discard(tmp)


@dataclass(frozen=True, slots=True)
class _CastFrom:
    """A bf16/f16 chunk predicted from the fp32 chunk ``source`` of the same checkpoint."""

    dtype: str  # BF16 or F16
    source: tuple[int, int]  # (tensor index, offset) of the fp32 chunk
    file_offset: int  # of the fp32 chunk in the new base cache file
    length: int
    written: threading.Event  # set once the fp32 chunk is in the cache file


def _encode_job(
    raw: np.ndarray,
    itemsize: int,
    level: int,
    base_fd: int | None,
    base: _BaseChunk | None,
    delta: bool,
    cache_fd: int,
    cache_offset: int,
    cast: _CastFrom | None,
    written: threading.Event | None,
    scratch: np.ndarray,
) -> codec.EncodedChunk:
    try:
        predicted: bytes | None = None
        parent: memoryview | None = None
        if cast is not None:
            cast.written.wait()
            source = os.pread(cache_fd, cast.length, cast.file_offset)
            predicted = codec.cast_prediction(source, cast.dtype)
        if base is not None and base_fd is not None:
            view = scratch[: len(raw)]
            if os.preadv(base_fd, [view.data], base.file_offset) != len(raw):
                raise RuntimeError("base cache file is shorter than the catalog says")
            parent = view.data
        os.pwrite(cache_fd, raw.data, cache_offset)
    finally:
        if written is not None:
            written.set()  # also on failure: the ingest fails anyway, nobody must hang
    if predicted is not None:
        assert cast is not None
        # a delta on the prediction adds no chain link: every gain counts
        enc = codec.encode_chunk(raw.data, predicted, itemsize, level, min_gain=0.0)
        if enc.codec == codec.REF or codec.is_delta(enc.codec):
            return replace(enc, codec=f"{codec.CASTS[cast.dtype]}|{enc.codec}")
        # the copy is not a rounding of its master after all: the parent may do better
    return codec.encode_chunk(raw.data, parent, itemsize, level, delta=delta)


def _cleanup(fn: Callable[..., object], *args: object) -> bool:
    """One clean-up step after a failed save; its own failure is logged, not raised (the
    ``writing`` row and blob it leaves are collected at the next start-up). Returns whether
    it succeeded."""
    try:
        fn(*args)
    except Exception as exc:
        log.warning("clean-up after a failed save: %s: %s", type(exc).__name__, exc)
        return False
    return True


def _blob_gone(store: BlobStore, key: str) -> bool:
    """Delete a failed save's blob; whether it is gone (or was never written). Only then may
    its ``writing`` row go: the row is what names a finished blob to the start-up
    collection, which nothing else would ever find."""
    if _cleanup(store.delete, key):
        return True
    try:
        return not store.exists(key)
    except Exception:
        return False


def _inline(fn: Callable[..., codec.EncodedChunk], *args: object) -> Future[codec.EncodedChunk]:
    future: Future[codec.EncodedChunk] = Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:
        future.set_exception(exc)
    return future


def _cast_sources(header: Header) -> dict[int, int]:
    """bf16/f16 tensors that look like rounded copies of an earlier fp32 tensor.

    The pairing is by shape and by name below the first path component, so
    ``model/fc.weight`` (bf16) pairs with ``master/fc.weight`` (fp32). A tensor with several
    candidates is left alone. Clients send fp32 tensors first so the master has arrived.
    """
    fp32: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    sources = {}
    for i, t in enumerate(header.tensors):
        tail = t.name.partition("/")[2]
        if not tail or not t.nbytes:
            continue
        if t.dtype == "F32":
            fp32.setdefault((tail, t.shape), []).append(i)
        elif t.dtype in codec.CASTS:
            found = fp32.get((tail, t.shape), [])
            if len(found) == 1:
                sources[i] = found[0]
    return sources


def ingest(
    rt: Runtime, run: str, step: int, body: Iterable[bytes], content_length: int | None
) -> tuple[CheckpointRecord, bool]:
    """Store one checkpoint from a safetensors stream; returns (info, created).

    ``created`` is False when the same step already holds identical content (an idempotent
    retry); different content raises CheckpointExists.
    """
    s = rt.settings
    parser = StreamParser(s.max_header_bytes, s.max_upload_bytes)
    it = iter(body)
    header, first = read_header(parser, it)
    _check_metadata(header)
    if content_length is not None and content_length != header.total_len:
        raise InvalidStream(
            f"Content-Length {content_length} disagrees with the header, which describes "
            f"{header.total_len} bytes"
        )
    with rt.catalog.run_lock(run):
        existing = rt.catalog.find(run, step)
        if existing is not None:
            return _verify_existing(rt, existing, parser, header, first, it), False
        return _store(rt, run, step, parser, header, first, it), True


def _tensor_stream(
    parser: StreamParser, first: list[TensorPiece], it: Iterator[bytes]
) -> Iterator[TensorPiece]:
    yield from first
    for data in it:
        for event in parser.feed(data):
            assert isinstance(event, TensorPiece)
            yield event
    parser.close()


def _verify_existing(
    rt: Runtime,
    existing: CheckpointRecord,
    parser: StreamParser,
    header: Header,
    first: list[TensorPiece],
    it: Iterator[bytes],
) -> CheckpointRecord:
    # by name: the order of the tensors in the stream is free (clients have changed it)
    stored = {t.name: (t.dtype, t.shape, t.checksum) for t in rt.catalog.tensors(existing.id)}
    hashers = [xxhash.xxh3_128() for _ in header.tensors]
    for piece in _tensor_stream(parser, first, it):
        hashers[piece.index].update(piece.data)
    sent = {
        t.name: (t.dtype, t.shape, h.digest()) for t, h in zip(header.tensors, hashers, strict=True)
    }
    if existing.metadata == header.metadata and sent == stored:
        return existing
    raise CheckpointExists(
        f"run {existing.run!r} already has a different checkpoint at step {existing.step}"
    )


def _store(
    rt: Runtime,
    run: str,
    step: int,
    parser: StreamParser,
    header: Header,
    first: list[TensorPiece],
    it: Iterator[bytes],
) -> CheckpointRecord:
    s = rt.settings
    t_start = time.perf_counter()
    parent = rt.catalog.parent_of(run, step)
    keyframe = parent is None or parent.since_keyframe + 1 >= s.keyframe_interval
    base_fd = None
    cache_tmp = None
    index: dict[tuple[str, str, tuple[int, ...], int, int], _BaseChunk] = {}
    if parent is not None:
        parent_tensors = {t.idx: t for t in rt.catalog.tensors(parent.id)}
        index = _base_index(rt, parent, parent_tensors)
        base_fd = rt.cache.open(run, parent.id)
        if base_fd is None:
            base_fd = _rebuild_base(rt, run, parent)
        if _same_offsets(parent_tensors.values(), header):
            cache_tmp = rt.cache.take(run, parent.id, base_fd)
    try:
        run_id = rt.catalog.ensure_run(run)
        key = blob_key(run, step)
        checkpoint_id = rt.catalog.begin_upload(run_id, step, key)
    except BaseException:
        if base_fd is not None:
            os.close(base_fd)
        if cache_tmp is not None:
            rt.cache.discard(cache_tmp)  # the cache lost the parent: a later save rebuilds it
        raise
    if cache_tmp is None:
        cache_tmp = rt.cache.new_file(run)
    cache_fd = os.open(cache_tmp, os.O_RDWR | os.O_CREAT, 0o600)
    writer = _BlobWriter(rt.store, key)
    committed = False
    pending: deque[_Pending] = deque()
    try:
        chunks: list[NewChunk] = []
        position: dict[tuple[int, int], int] = {}  # (tensor, offset) -> index in chunks
        siblings: dict[int, int] = {}  # chunk index -> index of its fp32 base chunk
        sources = _cast_sources(header)
        needed = set(sources.values())
        written: dict[tuple[int, int], threading.Event] = {}
        blob_offset = 0
        # Chunks in flight in the codec pool hold a buffer each: at most ``in_flight`` of them.
        # Small chunks, encoded here at once, hold only what they encoded while they wait for
        # the chunks before them to be written, and do not wait on the pool: the ingest goes
        # on parsing (a state's many small tensors come last, see upload_order in
        # ckptstore.state) while the pool finishes. Each counts at least _SMALL_COST bytes
        # (its future and bookkeeping weigh ~1 KB): at most in_flight x chunk_bytes of them.
        max_held = rt.budget.in_flight
        max_small = rt.budget.bytes_in_flight
        held = small = 0

        def drain(final: bool) -> None:
            nonlocal blob_offset, held, small
            while pending and (final or held > max_held or small > max_small):
                p = pending.popleft()
                enc = p.future.result()
                if p.block is None:
                    small -= max(p.raw_len, _SMALL_COST)
                else:
                    free.append(p.block)
                    held -= 1
                base_id, depth = None, 0
                if p.cast is not None and codec.split_cast(enc.codec):
                    siblings[len(chunks)] = position[p.cast.source]
                    depth = chunks[position[p.cast.source]].depth + 1
                elif enc.codec == codec.REF or codec.is_delta(enc.codec):
                    assert p.base is not None
                    base_id = p.base.chunk_id
                    depth = p.base.depth + codec.is_delta(enc.codec)
                position[(p.tensor_idx, p.offset)] = len(chunks)
                if p.tensor_idx not in hashers:
                    digests[p.tensor_idx] = enc.checksum
                size = enc.size
                for part in enc.parts:
                    writer.write(part)
                chunks.append(
                    NewChunk(
                        tensor_idx=p.tensor_idx,
                        offset=p.offset,
                        raw_len=p.raw_len,
                        itemsize=p.itemsize,
                        codec=enc.codec,
                        base_id=base_id,
                        depth=depth,
                        blob_offset=blob_offset,
                        stored_len=size,
                        checksum=enc.checksum,
                    )
                )
                blob_offset += size

        # A tensor that is one chunk has the chunk's checksum, which the codec thread computes
        # anyway; only tensors of several chunks are hashed here, as they stream by.
        digests: list[bytes | None] = [None] * len(header.tensors)
        hashers = {
            i: xxhash.xxh3_128()
            for i, t in enumerate(header.tensors)
            if not 0 < t.nbytes <= codec.chunk_step(t.itemsize, s.chunk_bytes)
        }
        # Chunk buffers are recycled once encoded: fresh ones cost a page fault per 4 KiB.
        free: list[np.ndarray] = []
        largest = codec.chunk_step(8, s.chunk_bytes)
        block = buf = np.empty(0, np.uint8)
        for piece in _tensor_stream(parser, first, it):
            spec = header.tensors[piece.index]
            hasher = hashers.get(piece.index)
            if hasher is not None:
                hasher.update(piece.data)
            step_bytes = codec.chunk_step(spec.itemsize, s.chunk_bytes)
            data, pos = np.frombuffer(piece.data, np.uint8), piece.offset
            while len(data):
                begin = pos - pos % step_bytes  # the chunk that byte ``pos`` falls in
                end = min(begin + step_bytes, spec.nbytes)
                take = min(len(data), end - pos)
                if pos == begin:
                    # one half for the chunk, one for its base (read in the job)
                    block = free.pop() if free else np.empty(2 * largest, np.uint8)
                    buf = block[: end - begin]
                # a numpy copy releases the GIL, which the codec threads are waiting for
                buf[pos - begin : pos - begin + take] = data[:take]
                data, pos = data[take:], pos + take
                if pos < end:
                    continue
                base = index.get((spec.name, spec.dtype, spec.shape, begin, end - begin))
                delta = not keyframe and base is not None and base.depth < s.max_chain_depth
                cast = None
                if piece.index in sources:
                    src = header.tensors[sources[piece.index]]
                    src_begin = begin // spec.itemsize * 4
                    cast = _CastFrom(
                        spec.dtype,
                        (sources[piece.index], src_begin),
                        src.begin + src_begin,
                        (end - begin) // spec.itemsize * 4,
                        written[(sources[piece.index], src_begin)],
                    )
                done = None
                if piece.index in needed:
                    done = written[(piece.index, begin)] = threading.Event()
                # a small chunk costs less to encode here than to hand to a codec thread
                inline = end - begin < _INLINE_BYTES
                future = (_inline if inline else rt.pool.submit)(
                    _encode_job,
                    buf,
                    spec.itemsize,
                    s.zstd_level,
                    base_fd,
                    base,
                    delta,
                    cache_fd,
                    spec.begin + begin,
                    cast,
                    done,
                    block[largest:],
                )
                if inline:  # encoded: what it returned holds bytes of its own
                    free.append(block)
                    small += max(end - begin, _SMALL_COST)
                    future.result()  # a failure stops the upload now, not at the next drain
                else:
                    held += 1
                pending.append(
                    _Pending(
                        piece.index,
                        begin,
                        end - begin,
                        spec.itemsize,
                        base,
                        cast,
                        None if inline else block,
                        future,
                    )
                )
                drain(final=False)
        t_body = time.perf_counter()
        drain(final=True)
        t_encoded = time.perf_counter()
        stored_bytes = writer.finish()
        t_durable = time.perf_counter()
        for i, hasher in hashers.items():
            digests[i] = hasher.digest()
        tensors = []
        for i, (t, digest) in enumerate(zip(header.tensors, digests, strict=True)):
            if digest is None:
                raise InternalError(f"tensor {t.name!r} of one chunk got no chunk checksum")
            tensors.append(TensorInfo(i, t.name, t.dtype, t.shape, t.begin, t.nbytes, digest))
        rt.catalog.commit_upload(
            checkpoint_id,
            parent_id=None if parent is None else parent.id,
            keyframe=keyframe or all(c.depth == 0 for c in chunks),
            chain_depth=max((c.depth for c in chunks), default=0),
            since_keyframe=0 if keyframe or parent is None else parent.since_keyframe + 1,
            raw_bytes=header.data_len,
            stored_bytes=stored_bytes,
            metadata=dict(header.metadata),
            tensors=tensors,
            chunks=chunks,
            sibling_bases=siblings,
        )
        committed = True
        t_end = time.perf_counter()
        log.info(
            "saved %s/%d: %d -> %d bytes in %.2fs (body %.2fs, encode tail %.2fs, "
            "blob finish %.2fs, commit %.2fs)",
            run,
            step,
            header.data_len,
            stored_bytes,
            t_end - t_start,
            t_body - t_start,
            t_encoded - t_body,
            t_durable - t_encoded,
            t_end - t_durable,
        )
    finally:
        try:
            if not committed:
                for p in pending:
                    p.future.cancel()
                for p in pending:
                    if not p.future.cancelled():
                        p.future.exception()  # wait: the job may still write to cache_fd
                # Each step on its own: the save's own error is what the client must see
                # (a blob store that refused the write refuses the delete too), and the
                # steps after a failed one still run, but for the row of a blob that may
                # still be there.
                _cleanup(writer.abort)
                if _blob_gone(rt.store, key):
                    _cleanup(rt.catalog.abort_upload, checkpoint_id)
                _cleanup(rt.cache.discard, cache_tmp)
        finally:
            if base_fd is not None:
                os.close(base_fd)
            os.close(cache_fd)
    _install_if_latest(rt, run, checkpoint_id, cache_tmp, header.data_len)
    return rt.catalog.get(run, step)
