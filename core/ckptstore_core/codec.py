"""Chunk codec: residuals against the previous checkpoint, byte planes, zstandard.

A tensor travels and is stored in chunks of a few MiB. Each chunk is encoded on its own,
optionally against its *base*: the same bytes (same tensor name, dtype, shape, offset) in the
parent checkpoint. The encoder tries:

* ``ref`` -- the chunk equals its base: nothing is stored;
* ``sub`` -- integer subtraction of the raw bit patterns (``raw - base`` as unsigned ints of the
  element size, wrapping), which keeps slowly moving floats' high bytes near zero;
* ``zsub`` -- the same difference zigzag-encoded (``(d << 1) ^ (d >> bits-1)``), so small
  negative steps do not fill the high byte planes with 0xFF: 3-6% smaller than ``sub`` on
  weights in bench/ runs;
* ``xor`` -- ``raw ^ base``;
* ``scale`` (fp32 only) -- ``zsub`` against ``base`` times a factor the encoder finds in the
  chunk (see :func:`ckptstore_core.planes.scale`): the rows of an embedding that saw no token
  since the base only decayed (Adam's moments by 0.9 and 0.999 per step), which ``zsub``
  leaves as a large residual and the scaled base predicts to within a few ulps;
* ``none`` -- no delta; chosen unless a delta is at least 5% smaller (``DELTA_MIN_GAIN``):
  every delta is one more link for each later restore of the chain to decode;

then splits the residual into byte planes (plane *i* holds byte *i* of every element, so the
sign/exponent bytes of floats sit together) and stores each plane the smallest way: zstd;
*sparse* (the nonzero bytes of a mostly-zero plane as a list, see
:func:`ckptstore_core.planes.sparse_pack`, in one zstd frame: the top byte of a slowly moving
weight's residual is nonzero in a few percent of the elements); or raw when neither pays (the
low mantissa bytes of trained floats are noise: compressing them wastes CPU; a plane must
shrink by 15%, or decoding it costs more than its bytes are worth). When at least
1/8 of the elements have a zero residual, in stretches, a *runs* layer lists the runs of the
others and the planes hold only those (embedding rows that fine-tuning never touches). Mode and
per-plane choices are made on a sample of the chunk, then the whole chunk is encoded once.
Chunks under 64 KiB are never deltas (a restore decodes a delta's whole chain). If the result
is not smaller than the input, the chunk is stored ``raw``.

Codec specs are versioned strings recorded with every chunk, e.g. ``zsub/1|planes4/2|zstd/1``
or ``scale/1|zsub/1|runs/1|planes4/1|zstd/1``. Payload of a planes codec, all integers
little-endian:

* with ``scale/1`` first the ``u32`` bit pattern of the factor, a normal fp32;
* then, with ``runs/1``, ``u32 count, u32 length`` and a zstd frame of ``count`` u32 pairs
  ``(skip, length)``: skip that many elements (zero residual), then keep that many;
* then ``u8 count`` and per plane ``u8 kind, u32 length``, then the plane bodies back to back. Kind
  0 is raw, 1 one zstd frame, 2 (``planes/2`` only) sparse: ``u32 nonzero, u32 gap bytes``
  then one zstd frame of the gap bytes and the nonzero values (no frame if there are none).

A chain may also hold ``lossy/1`` links (:mod:`ckptstore_core.lossy`, opt-in, fp32 only):
decoded by :func:`ckptstore_core.lossy.decode` against the chain's result so far, their
checksum is the one of the reconstruction; :func:`encode_chunk` never produces them.

Every chunk carries the xxh3-128 of its raw bytes; :func:`decode_chunk` verifies it and raises
:class:`~ckptstore_core.errors.CorruptData` on a mismatch. numpy + zstandard, no torch.
zstandard contexts are not thread-safe, so each thread gets its own. The residual and plane
transposition run in :mod:`ckptstore_core.planes` (fused numba kernels when installed).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import xxhash
import zstandard

from ckptstore_core import lossy, planes
from ckptstore_core.errors import CorruptData

__all__ = [
    "Buffer",
    "EncodedChunk",
    "checksum",
    "CASTS",
    "cast_prediction",
    "chunk_step",
    "decode_chain",
    "decode_chunk",
    "is_delta",
    "split_cast",
    "encode_chunk",
]

Buffer = bytes | bytearray | memoryview

REF = "ref"
RAW = "raw/1"
_MODES = tuple(planes.MODES)  # "none" first: the others are deltas
_PLANE_RAW, _PLANE_ZSTD, _PLANE_SPARSE = 0, 1, 2
# A sparse plane: u32 count of nonzero bytes, u32 length of their gap stream, then one zstd
# frame of the gap stream and the values (see planes.sparse_pack); no frame if count is 0.
_SPARSE_HEAD = struct.Struct("<II")
# A runs layer: u32 count of runs, u32 length of one zstd frame of the runs as u32 pairs
# (skip, length): the elements whose residual is zero are left out of the planes.
_RUNS_HEAD = struct.Struct("<II")
# A scale layer: u32 bit pattern of an fp32 factor; the residual is zsub against the base
# times the factor (see planes.scale): the rows that only decay between two checkpoints.
_SCALE = "scale"
_SCALE_HEAD = struct.Struct("<I")
# The factor must fit at least this share of a sample's nonzero finite elements (and 32 of
# them), within this relative width.
_SCALE_MIN_SHARE = 8
_SCALE_WIDTH = 2.0**-19
_SCALE_PROBE = 1024  # sample elements the factor is estimated on
_SCALE_MIN_COUNT = 32
_RUNS_MIN_SHARE = 8  # zero elements must be at least 1/8 of the chunk
_RUNS_MIN_GAP = 16  # and come in stretches this long on average
# A chunk's planes are compressed in one call when they hold more than this (_compress).
_ONE_CALL_BYTES = 64 << 10
# A plane is stored raw unless zstd gets it below this fraction of its size.
_PLANE_GAIN = 0.85
# Chunks above this size choose their mode and planes on a sample of this many bytes.
_SAMPLE_BYTES = 32 << 10
# Modes the encoder tries (plain ``sub`` rarely beats ``zsub``; it stays decodable).
_TRY_MODES = ("none", "zsub", "xor")
_SAMPLE_WINDOWS = 4
#: A delta must be at least this much smaller than the chunk on its own: a restore decodes
#: every link of a chain, and deltas that save a few percent (the Adam moments of a model
#: trained from scratch) were 40% of a deep restore's decode time in bench/chains.py.
DELTA_MIN_GAIN = 0.05
# Chunks below this size are stored whole, never as deltas: a restore walks a delta's whole
# chain, one decode per link, and for a bias or a norm's weights that costs far more time
# than the few bytes the delta saves (bench/: 0.1% of the bytes, half of the chain links).
_DELTA_MIN_BYTES = 64 << 10
# No zstd frame of one byte or more is shorter than this (magic, frame header, content
# size, block header, one byte): a chunk too short for its planes ever to be smaller than
# it is stored raw at once. A save's optimizer step counters, scalars, are a third of its
# tensors; each cost ~0.1 ms of planes and frames to find that out.
_MIN_FRAME = 9


@dataclass(frozen=True, slots=True)
class EncodedChunk:
    codec: str
    # the stored payload in pieces (none for ref), written one after the other: joining
    # them would copy each chunk's payload once more, holding the GIL
    parts: tuple[Buffer, ...]
    checksum: bytes  # xxh3-128 of the raw bytes, 16 bytes big-endian

    @property
    def size(self) -> int:
        return _size(self.parts)

    @property
    def payload(self) -> bytes:
        return b"".join(self.parts)


def is_delta(codec: str) -> bool:
    """Whether a chunk stored with ``codec`` is decoded from its base (``ref`` is not)."""
    head = codec.split("/")[0]
    return head in _MODES[1:] or head == _SCALE or codec == lossy.LOSSY


def checksum(data: Buffer) -> bytes:
    return xxhash.xxh3_128_digest(data)


def file_checksum(fd: int, begin: int, size: int, read_bytes: int = 4 << 20) -> bytes | None:
    """The :func:`checksum` of ``size`` bytes of file ``fd`` at ``begin``, read
    ``read_bytes`` at a time; None if the file ends before them."""
    hasher = xxhash.xxh3_128()
    for off in range(begin, begin + size, read_bytes):
        n = min(read_bytes, begin + size - off)
        data = os.pread(fd, n, off)
        if len(data) != n:
            return None
        hasher.update(data)
    return hasher.digest()


def chunk_step(itemsize: int, chunk_bytes: int) -> int:
    """Chunk length in bytes for a tensor of ``itemsize``-byte elements.

    Chunks hold ``chunk_bytes / 4`` elements whatever the dtype, so tensors of one shape but
    different dtypes (a bf16 weight and its fp32 master copy) are cut at the same elements and
    chunk ``k`` of one can be predicted from chunk ``k`` of the other. A tensor of ``n`` bytes
    is split into chunks ``[k * step, min((k + 1) * step, n))``.
    """
    return max(1, chunk_bytes // 4) * itemsize


#: Lower-precision copies that can be predicted from an fp32 tensor, by wire dtype.
CASTS = {"BF16": "cast-bf16/1", "F16": "cast-f16/1"}


def cast_prediction(source: Buffer, dtype: str) -> bytes:
    """What ``dtype`` (``BF16``/``F16``) copies of the fp32 values in ``source`` hold when
    they were made by rounding to nearest even, as mixed-precision training does."""
    values = np.frombuffer(source, dtype="<u4")
    if dtype == "F16":
        return values.view("<f4").astype("<f2").tobytes()
    if dtype != "BF16":
        raise ValueError(f"no cast prediction for {dtype}")
    return planes.round_bf16(values).tobytes()


def split_cast(codec: str) -> tuple[str, str] | None:
    """``("BF16", inner codec)`` for a chunk stored against a cast prediction, else None."""
    head, sep, inner = codec.partition("|")
    for dtype, spec in CASTS.items():
        if head == spec and sep:
            return dtype, inner
    return None


_local = threading.local()


# A byte plane of floats is mostly literals: a small match table (2**8 entries) finds its few
# real repeats (runs of zeros), stays in L1 and leaves the rest to Huffman. On bench/ planes
# that is 1.7-2.5x faster than level 1's default table, and 2-6% smaller.
_PLANE_HASH_LOG = 8


def _cctx(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("c", {})
    ctx = cache.get(level)
    if ctx is None:
        params = zstandard.ZstdCompressionParameters.from_level(level, hash_log=_PLANE_HASH_LOG)
        ctx = cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return ctx


def _dctx() -> zstandard.ZstdDecompressor:
    ctx: zstandard.ZstdDecompressor | None = _local.__dict__.get("d")
    if ctx is None:
        ctx = _local.d = zstandard.ZstdDecompressor()
    return ctx


def _sample(arr: np.ndarray, count: int) -> np.ndarray:
    """``count`` elements (along the last axis) from a few windows spread over ``arr``."""
    n = arr.shape[-1]
    if n <= 2 * count:
        return arr
    window = count // _SAMPLE_WINDOWS
    stride = (n - window) // (_SAMPLE_WINDOWS - 1)
    parts = [arr[..., i * stride : i * stride + window] for i in range(_SAMPLE_WINDOWS)]
    return np.concatenate(parts, axis=-1)


def _scale_factor(raw: np.ndarray, base: np.ndarray) -> int | None:
    """The bit pattern of an fp32 factor that maps at least 1/8 of ``base``'s elements
    (``_SCALE_PROBE`` of them, fp32 bit patterns) onto ``raw``'s to within a few ulps, if
    there is one: rows that only decayed since the base (weight decay on embedding rows that
    saw no token, the Adam moments of those rows: 0.9**25 and 0.999**25 after 25 steps)."""
    stride = max(1, len(raw) // _SCALE_PROBE)
    return planes.scale_factor(raw, base, stride, _SCALE_WIDTH, _SCALE_MIN_COUNT, _SCALE_MIN_SHARE)


def _zero_runs(mask: np.ndarray, kept: int) -> np.ndarray | None:
    """The runs of elements whose residual is nonzero (``mask``: ``kept`` of them), if
    leaving out the others pays: at least 1/8 of the elements are zero, in stretches of 16+
    on average (the rows of an embedding or of its Adam moments that fine-tuning did not
    touch)."""
    n = len(mask)
    zeros = n - kept
    if not kept or zeros * _RUNS_MIN_SHARE < n:
        return None
    runs = planes.element_runs(mask)
    return runs if len(runs) // 2 * _RUNS_MIN_GAP <= zeros else None


class _Stored(NamedTuple):
    """One byte plane as stored: its kind, its size in bytes and its body in parts."""

    kind: int
    size: int
    parts: list[Buffer]


_Packed = tuple[str, int, list[_Stored]]  # mode, total size, the planes as stored


def _pack_planes(
    split: dict[str, np.ndarray],
    level: int,
    kinds: Sequence[int] | None,
    gain: float,
) -> list[_Packed]:
    """For each mode, its residual's byte planes (``split``), each stored the smallest way
    it is allowed (``kinds`` per plane; every way if None): zstd, sparse, or raw when neither
    gets below ``gain`` x its size. Returns (mode, total size, the planes as stored).
    This runs for every chunk, holding the GIL between its kernels: sizes are plain ints,
    compared in plain loops, and the planes are compressed in one call (:func:`_compress`)."""
    jobs: list[Buffer] = []
    # per plane: its zstd job, its sparse header and the sparse stream's job (-1: none)
    slots: list[tuple[int, bytes | None, int]] = []
    for m in split:
        for i, plane in enumerate(split[m]):
            kind = None if kinds is None else kinds[i]
            z = s = -1
            head = None
            if kind is None or kind == _PLANE_ZSTD:
                z = len(jobs)
                jobs.append(plane.data)
            # sparse is tried on planes that are at least half zero bytes
            if kind == _PLANE_SPARSE or (
                kind is None and 2 * np.count_nonzero(plane) <= len(plane)
            ):
                count, stream = planes.sparse_pack(plane)
                head = _SPARSE_HEAD.pack(count, len(stream) - count)
                if count:
                    s = len(jobs)
                    jobs.append(stream.data)
            slots.append((z, head, s))
    frames = _compress(jobs, level)
    out = []
    k = 0
    for m in split:
        stored: list[_Stored] = []
        total = 0
        for plane in split[m]:
            z, head, s = slots[k]
            k += 1
            # the smallest under the limit; on a tie sparse, which decodes several times faster
            best = _Stored(_PLANE_RAW, len(plane), [plane.data])
            limit: float = gain * len(plane)
            if head is not None:
                size = len(head) + (len(frames[s]) if s >= 0 else 0)
                if size < limit:
                    best = _Stored(_PLANE_SPARSE, size, [head, frames[s]] if s >= 0 else [head])
                    limit = size
            if z >= 0 and len(frames[z]) < limit:
                best = _Stored(_PLANE_ZSTD, len(frames[z]), [frames[z]])
            stored.append(best)
            total += best.size
        out.append((m, total, stored))
    return out


def _compress(jobs: list[Buffer], level: int) -> Sequence[Buffer]:
    """Each of ``jobs`` as one zstd frame, all in one call on the thread's context.

    One call releases the GIL once for all of a chunk's planes (a chunk's mode trials are
    12-16 planes of 8 KiB): each release is a hand-off, and taking the GIL back waits for
    whatever Python another thread runs. With two codec threads, one ``compress`` per plane
    cost the bench's fine-tune chunks 3.25 core-s per GB of encode, one call 3.05
    (docs/benchmarks.md). The frames are byte for byte those of ``compress``, each in a
    buffer of its exact size. Jobs of a small chunk, 64 KiB in all or less, are compressed
    one by one: the one call costs ~20 us more to set up, ~4 compresses of a few hundred
    bytes."""
    cctx = _cctx(level)
    if len(jobs) < 2 or _size(jobs) <= _ONE_CALL_BYTES:
        return [cctx.compress(data) for data in jobs]
    frames = cctx.multi_compress_to_buffer(jobs)
    # a BufferSegment exports the buffer protocol (its stub does not say so)
    return [memoryview(frames[i]) for i in range(len(jobs))]  # type: ignore[arg-type]


def _best(tries: list[_Packed], min_gain: float) -> _Packed:
    """The smallest of ``tries`` (mode ``none`` first), but ``none`` unless a delta is at
    least ``min_gain`` smaller than it."""
    best = min(tries, key=lambda t: t[1])
    return best if best[1] <= (1 - min_gain) * tries[0][1] else tries[0]


def _size(parts: Sequence[Buffer]) -> int:
    return sum(len(p) for p in parts)


def encode_chunk(
    raw: Buffer,
    base: Buffer | None,
    itemsize: int,
    level: int = 1,
    *,
    delta: bool = True,
    min_gain: float = DELTA_MIN_GAIN,
) -> EncodedChunk:
    """Encode one chunk of a tensor with elements of ``itemsize`` bytes.

    ``base`` is the same chunk of the parent checkpoint (same length) or None. With
    ``delta=False`` the base is only used to detect an unchanged chunk (``ref``): a changed
    chunk is then encoded on its own, which is how keyframes cut a chain. A delta is chosen
    only where it is at least ``min_gain`` smaller than the chunk on its own (as estimated on
    the sample): each delta is one more link that restoring this checkpoint or any later one
    in its chain decodes.
    """
    digest = checksum(raw)
    if len(raw) % itemsize:
        raise ValueError(
            f"chunk of {len(raw)} bytes is not a whole number of {itemsize}-byte items"
        )
    if base is not None and len(base) != len(raw):
        raise ValueError("base chunk length differs from the chunk")
    if base is not None and _equal(raw, base):
        return EncodedChunk(REF, (), digest)
    if not len(raw):
        return EncodedChunk(RAW, (), digest)
    if _planes_lose(len(raw), itemsize):
        return EncodedChunk(RAW, (bytes(raw),), digest)  # a copy: the caller reuses ``raw``
    if not delta or len(raw) < _DELTA_MIN_BYTES:
        base = None
    uint = planes.UINT[itemsize]
    raw_v = np.frombuffer(raw, dtype=uint)
    base_v = None if base is None else np.frombuffer(base, dtype=uint)
    modes: tuple[str, ...] = _TRY_MODES if base_v is not None else ("none",)
    factor = None

    def against(m: str, base_v: np.ndarray | None) -> tuple[np.ndarray | None, int]:
        """What mode ``m`` takes its residual against, and the kernels' number for it."""
        if base_v is None:
            return None, planes.MODES["none"]
        if m == _SCALE:
            assert factor is not None
            predicted = base_v.copy()
            planes.scale(predicted, factor)
            return predicted, planes.MODES["zsub"]
        return base_v, planes.MODES[m]

    count = max(1, _SAMPLE_BYTES // itemsize)
    raw_s = _sample(raw_v, count)
    base_s = None if base_v is None else _sample(base_v, count)
    if itemsize == 4 and base_s is not None:
        factor = _scale_factor(raw_s, base_s)
        if factor is not None:
            modes += (_SCALE,)
    if len(raw_v) <= 2 * count:
        # small chunk: every mode, zstd or raw planes, the smallest kept (sparse planes and
        # runs pay on large mostly-zero planes; here they would only cost time)
        split = {m: planes.split(raw_v, *against(m, base_v)) for m in modes}
        tries = _pack_planes(split, level, [_PLANE_ZSTD] * itemsize, 1.0)
        mode, _, stored = _best(tries, min_gain)
        runs = None
    else:
        # large chunk: choose the mode and the planes worth compressing on a sample
        trials = _pack_planes(
            {m: planes.split(raw_s, *against(m, base_s)) for m in modes}, level, None, _PLANE_GAIN
        )
        mode, _, chosen = _best(trials, min_gain)
        kinds: list[int] | None = [p.kind for p in chosen]
        full, mask, kept = planes.split_nonzero(raw_v, *against(mode, base_v))
        runs = _zero_runs(mask, kept)
        if runs is not None:  # the kept elements' planes are denser: choose their kinds anew
            full = planes.compact(full, runs)
            kinds = None
            if full.shape[1] > 2 * count:
                [(_, _, chosen)] = _pack_planes(
                    {mode: _sample(full, count)}, level, None, _PLANE_GAIN
                )
                kinds = [p.kind for p in chosen]
        [(_, _, stored)] = _pack_planes({mode: full}, level, kinds, 1.0)
    parts: list[Buffer] = []
    layers = f"{mode}/1"
    if mode == _SCALE:
        assert factor is not None
        parts.append(_SCALE_HEAD.pack(factor))
        layers = f"{_SCALE}/1|zsub/1"
    if runs is not None:
        frame = _cctx(level).compress(runs.astype("<u4").tobytes())
        parts += [_RUNS_HEAD.pack(len(runs) // 2, len(frame)), frame]
        layers += "|runs/1"
    # the plane table as one part: each part is one more hand-off to the blob's writer
    table = [x for p in stored for x in (p.kind, p.size)]
    parts.append(struct.pack(f"<B{'BI' * len(stored)}", len(stored), *table))
    parts += [part for p in stored for part in p.parts]
    if _size(parts) >= len(raw):
        return EncodedChunk(RAW, (bytes(raw),), digest)  # a copy: the caller reuses ``raw``
    # planes/2 when a plane is sparse: readers of planes/1 only reject such chunks
    version = 2 if any(p.kind == _PLANE_SPARSE for p in stored) else 1
    return EncodedChunk(f"{layers}|planes{len(stored)}/{version}|zstd/1", tuple(parts), digest)


def _planes_lose(raw_len: int, itemsize: int) -> bool:
    """Whether no planes payload of a chunk of ``raw_len`` bytes can be smaller than it: a
    count, 5 bytes of table per plane, each plane its raw bytes or a zstd frame."""
    return 1 + itemsize * (5 + min(raw_len // itemsize, _MIN_FRAME)) >= raw_len


def _equal(a: Buffer, b: Buffer) -> bool:
    """Byte equality. (Comparing memoryviews is 30x slower: 13 ms per 4 MiB, item by
    item.)"""
    return planes.equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))


class _Link(NamedTuple):
    """A planes payload, parsed and checked before anything is decoded."""

    scale: int | None  # fp32 factor (bits) the base is multiplied by first
    mode: int  # kernel mode
    runs: np.ndarray | None  # u32 (skip, length) pairs of the elements the planes hold
    size: int  # bytes the planes hold: the chunk's, or those of the elements in runs
    table: list[_Plane]


def _parse_link(codec: str, payload: Buffer, itemsize: int, raw_len: int) -> _Link:
    parts = codec.split("|")
    body = memoryview(payload)
    scale = None
    if parts[0] == f"{_SCALE}/1":
        if itemsize != 4 or parts[1:2] != ["zsub/1"] or len(body) < _SCALE_HEAD.size:
            raise CorruptData(f"unknown codec spec {codec!r} for {itemsize}-byte items")
        (scale,) = _SCALE_HEAD.unpack_from(body)
        if not planes.is_normal_f32(np.array([scale], np.uint32))[0]:
            raise CorruptData(f"scale factor {scale:#x} is not a normal fp32")
        del parts[0]
        body = body[_SCALE_HEAD.size :]
    runs_layer = len(parts) == 4 and parts[1] == "runs/1"
    if runs_layer:
        del parts[1]
    if (
        len(parts) != 3
        or parts[0].split("/")[0] not in _MODES
        or parts[0].split("/")[1:] != ["1"]
        or parts[1] not in {f"planes{k}/{v}" for k in (itemsize, 1) for v in (1, 2)}
        or parts[2] != "zstd/1"
        or raw_len % itemsize
    ):
        raise CorruptData(f"unknown codec spec {codec!r} for {itemsize}-byte items")
    mode = planes.MODES[parts[0].split("/")[0]]
    runs = None
    if runs_layer:
        runs, body = _parse_runs(body, raw_len // itemsize)
        raw_len = int(runs[1::2].sum(dtype=np.int64)) * itemsize
    table = _plane_table(body, itemsize, raw_len, int(parts[1][-1]))
    return _Link(scale, mode, runs, raw_len, table)


def _parse_runs(payload: memoryview, n: int) -> tuple[np.ndarray, memoryview]:
    """The checked runs (u32 pairs) of a runs layer over ``n`` elements, and the payload
    after them."""
    if len(payload) < _RUNS_HEAD.size:
        raise CorruptData("truncated runs header")
    count, length = _RUNS_HEAD.unpack_from(payload)
    frame = payload[_RUNS_HEAD.size : _RUNS_HEAD.size + length]
    # runs are at least 1 long with gaps of at least 1 between them: at most (n + 1) // 2
    if not 0 < count <= (n + 1) // 2 or not 0 < length == len(frame):
        raise CorruptData(f"runs header ({count}, {length}) does not fit {n} elements")
    [data] = _decompress_all([frame], [8 * count])
    runs = np.frombuffer(data, "<u4")
    skips, lengths = runs[0::2], runs[1::2]
    if lengths.min() < 1 or (skips[1:] < 1).any() or runs.sum(dtype=np.int64) > n:
        raise CorruptData(f"runs do not fit {n} elements")
    return runs, payload[_RUNS_HEAD.size + length :]


def decode_chunk(
    codec: str,
    payload: Buffer,
    base: Buffer | None,
    itemsize: int,
    raw_len: int,
    expected: bytes,
) -> bytes:
    """Inverse of :func:`encode_chunk`; verifies the raw checksum. ``base`` as when encoded."""
    if codec == REF:
        if base is None:
            raise CorruptData("ref chunk without a base")
        links = [(RAW, base)]
    elif is_delta(codec):
        if base is None:
            raise CorruptData(f"{codec} chunk without a base")
        links = [(RAW, base), (codec, payload)]
    else:
        links = [(codec, payload)]
    return bytes(decode_chain(links, itemsize, raw_len, expected))


def decode_chain(
    links: Sequence[tuple[str, Buffer]], itemsize: int, raw_len: int, expected: bytes
) -> memoryview:
    """Decode a chunk from its chain: ``links`` are ``(codec, payload)`` pairs, the first one
    self-contained (``none``/``raw``), each next one a delta on the result so far.

    The deltas are applied in place on one buffer, and only the final bytes are checked
    against ``expected``: a corrupt link anywhere in the chain corrupts them too.
    """
    if not links or is_delta(links[0][0]) or links[0][0] == REF:
        raise CorruptData("a chunk's chain must start with a self-contained chunk")
    # both come from the catalog: an item size with no kernels, or a negative length, is
    # corrupt data too (not a KeyError, a ZeroDivisionError or numpy's ValueError)
    if itemsize not in planes.UINT or raw_len < 0 or raw_len % itemsize:
        raise CorruptData(f"a chunk of {raw_len} bytes for {itemsize}-byte items")
    uint = planes.UINT[itemsize]
    codec, payload = links[0]
    # every link is parsed and checked before anything is decoded
    parsed: list[_Link | Buffer] = []  # a lossy link is its payload, decoded in turn
    base: memoryview | None = None  # a raw first link (a kept chunk): the first join reads it
    if codec == RAW:
        if len(payload) != raw_len:
            raise CorruptData(f"raw chunk of {len(payload)} bytes, expected {raw_len}")
        base = memoryview(payload)
        if not base.c_contiguous:  # numpy views only contiguous bytes
            base = memoryview(base.tobytes())
        values = np.empty(raw_len // itemsize, dtype=uint)
    else:
        first = _parse_link(codec, payload, itemsize, raw_len)
        parsed.append(first)
        if first.mode != planes.MODES["none"]:
            raise CorruptData(f"a chain cannot start with a {codec} chunk")
        values = np.empty(raw_len // itemsize, dtype=uint)
    for codec, payload in links[1:]:
        if codec == lossy.LOSSY:
            # decoded against the result so far (the parent's reconstruction); only fp32
            if itemsize != 4:
                raise CorruptData(f"a {codec} chunk of {itemsize}-byte items")
            parsed.append(payload)
            continue
        link = _parse_link(codec, payload, itemsize, raw_len)
        if link.mode == planes.MODES["none"] or not is_delta(codec):
            raise CorruptData(f"{codec} chunk in the middle of a chain")
        parsed.append(link)
    source = None if base is None else _joined_base(base, parsed, uint)
    if base is not None and source is None:
        values[:] = np.frombuffer(base, dtype=uint)  # a copy: the deltas apply in place
    # link by link: one link's planes in memory at a time
    for item in parsed:
        if not isinstance(item, _Link):
            values = lossy.decode(item, values.view(np.float32), len(values)).view(uint)
            continue
        link = item
        table = link.table
        size = link.size // len(table)
        framed = [p for p in table if p.kind != _PLANE_RAW and p.size]
        unpacked = iter(_decompress_all([p.body for p in framed], [p.size for p in framed]))
        bodies = []
        for p in table:
            if p.kind == _PLANE_RAW:
                bodies.append(np.frombuffer(p.body, dtype=np.uint8))
                continue
            data = np.frombuffer(next(unpacked) if p.size else b"", dtype=np.uint8)
            if p.kind == _PLANE_ZSTD:
                bodies.append(data)
                continue
            dense = np.empty(size, np.uint8)
            if not planes.sparse_unpack(data, p.nonzero, dense):
                raise CorruptData("a sparse plane's gaps do not fit its chunk")
            bodies.append(dense)
        if len(bodies) < itemsize:  # one plane holding the elements' bytes in order
            bodies = [np.ascontiguousarray(bodies[0][i::itemsize]) for i in range(itemsize)]
        if link.scale is not None:
            planes.scale(values, link.scale)
        if link.runs is None:
            planes.join(bodies, values, link.mode, source)
        else:
            planes.join_runs(bodies, link.runs, values, link.mode, source)
        source = None  # the next link applies in place
    out = values.data.cast("B")  # the decoded array itself, not a copy of it
    if len(out) != raw_len:
        raise CorruptData(f"chunk decoded to {len(out)} bytes, expected {raw_len}")
    if checksum(out) != expected:
        raise CorruptData("chunk checksum mismatch: stored data is corrupt")
    return out


def _joined_base(
    base: Buffer, parsed: Sequence[_Link | Buffer], uint: np.dtype[Any]
) -> np.ndarray | None:
    """A raw first link as the array the first delta's join reads, rather than copy it into
    the chunk's buffer first (a pass over fresh memory: on a link decoded onto a kept chunk,
    about a third of its decode): when that delta is a planes link with no scale (which
    applies to the values in place) and the bytes are aligned for the kernels."""
    first = parsed[0] if parsed else None
    if not isinstance(first, _Link) or first.scale is not None:
        return None
    source: np.ndarray = np.frombuffer(base, dtype=uint)
    return source if source.ctypes.data % source.itemsize == 0 else None


class _Plane(NamedTuple):
    kind: int
    body: memoryview  # raw bytes, or the zstd frame (none for an all-zero sparse plane)
    size: int  # bytes the frame decompresses to
    nonzero: int = 0  # nonzero bytes of a sparse plane


def _plane_table(payload: memoryview, itemsize: int, raw_len: int, version: int) -> list[_Plane]:
    """The planes of a planes payload, lengths and sparse headers checked."""
    try:
        (count,) = struct.unpack_from("<B", payload, 0)
        entries = [struct.unpack_from("<BI", payload, 1 + 5 * i) for i in range(count)]
    except struct.error as exc:
        raise CorruptData(f"truncated plane table: {exc}") from exc
    if count not in (1, itemsize) or raw_len % itemsize:
        raise CorruptData(f"{count} planes for {itemsize}-byte items")
    if raw_len == 0:  # the encoder stores an empty chunk raw, never as planes
        raise CorruptData("a planes payload for an empty chunk")
    n = raw_len // count
    kinds = (_PLANE_RAW, _PLANE_ZSTD) + ((_PLANE_SPARSE,) if version >= 2 else ())
    pos = 1 + 5 * count
    table = []
    for i, (kind, length) in enumerate(entries):
        body = payload[pos : pos + length]
        pos += length
        if len(body) != length:
            raise CorruptData("truncated plane payload")
        if kind not in kinds or (kind == _PLANE_RAW and length != n):
            raise CorruptData(f"plane {i} holds {length} bytes, expected {n}")
        if kind == _PLANE_ZSTD and length == 0:
            raise CorruptData(f"plane {i} is an empty zstd frame")
        if kind == _PLANE_SPARSE:
            table.append(_sparse_plane(i, body, n))
        else:
            table.append(_Plane(kind, body, n))
    if pos != len(payload):
        raise CorruptData(f"{len(payload) - pos} bytes after the last plane")
    return table


def _sparse_plane(i: int, body: memoryview, n: int) -> _Plane:
    if len(body) < _SPARSE_HEAD.size:
        raise CorruptData(f"plane {i}: truncated sparse header")
    count, gap_len = _SPARSE_HEAD.unpack_from(body)
    frame = body[_SPARSE_HEAD.size :]
    # each nonzero byte has one gap byte, plus one 255 per 255 zeros skipped: bounded by n
    if (
        count > n
        or not count <= gap_len <= count + n // 255
        or bool(count) != bool(frame)
        or (count == 0 and gap_len)
    ):
        raise CorruptData(f"plane {i}: sparse header ({count}, {gap_len}) does not fit {n} bytes")
    return _Plane(_PLANE_SPARSE, frame, gap_len + count, count)


def _decompress_all(frames: list[memoryview], sizes: list[int]) -> list[Any]:
    """Each zstd frame decompressed, holding exactly its size in ``sizes``.

    One ``decompress`` per frame on the thread's context: ``multi_decompress_to_buffer`` sets
    up a fresh context per call, ~25 us that a chunk's whole decode of a few KiB, or one link
    of a deep chain, cannot afford (bench/: 10-15% of a deep restore's zstd time). Each
    frame's header must state its size before anything is allocated for it.
    """
    dctx = _dctx()
    out = []
    for frame, size in zip(frames, sizes, strict=True):
        try:
            if zstandard.frame_content_size(frame) != size:
                raise CorruptData("a zstd plane does not hold the bytes its chunk needs")
            out.append(dctx.decompress(frame, allow_extra_data=False))
        except (zstandard.ZstdError, ValueError) as exc:
            raise CorruptData(f"zstd plane does not decode: {exc}") from exc
        if len(out[-1]) != size:
            raise CorruptData("a zstd plane does not hold the bytes its chunk needs")
    return out
