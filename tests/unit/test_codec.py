"""Chunk codec: exact round-trips, mode choice, and corruption detection."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore_core import codec
from ckptstore_core.codec import (
    DELTA_MIN_GAIN,
    REF,
    cast_prediction,
    checksum,
    chunk_step,
    decode_chunk,
    encode_chunk,
    is_delta,
    split_cast,
)
from ckptstore_core.errors import CorruptData

rng = np.random.default_rng(1234)


def roundtrip(raw: bytes, base: bytes | None, itemsize: int, **kw: object) -> str:
    enc = encode_chunk(raw, base, itemsize, **kw)  # type: ignore[arg-type]
    assert decode_chunk(enc.codec, enc.payload, base, itemsize, len(raw), enc.checksum) == raw
    return enc.codec


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even), as uint16."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_random_bytes_roundtrip(itemsize: int) -> None:
    raw = rng.integers(0, 256, 300_000 - 300_000 % itemsize, dtype=np.uint8).tobytes()
    base = rng.integers(0, 256, len(raw), dtype=np.uint8).tobytes()
    assert roundtrip(raw, None, itemsize) == "raw/1"  # noise does not compress
    roundtrip(raw, base, itemsize)


def test_unchanged_chunk_is_a_reference() -> None:
    raw = rng.standard_normal(100_000).astype(np.float32).tobytes()
    enc = encode_chunk(raw, raw, 4)
    assert enc.codec == REF and enc.payload == b""
    assert decode_chunk(REF, b"", raw, 4, len(raw), enc.checksum) == raw
    # a keyframe (delta=False) still shares unchanged chunks
    assert encode_chunk(raw, raw, 4, delta=False).codec == REF


def test_drifting_float32_gains_from_the_delta() -> None:
    w = rng.standard_normal(500_000).astype(np.float32)
    w2 = w + (rng.standard_normal(w.size) * 1e-4).astype(np.float32)
    raw, base = w2.tobytes(), w.tobytes()
    alone = encode_chunk(raw, None, 4)
    delta = encode_chunk(raw, base, 4)
    assert is_delta(delta.codec)
    assert len(delta.payload) < 0.8 * len(alone.payload)
    roundtrip(raw, base, 4)
    # without delta the chunk is stored on its own and decodes without a base
    solo = encode_chunk(raw, base, 4, delta=False)
    assert solo.codec.startswith("none/")
    assert decode_chunk(solo.codec, solo.payload, None, 4, len(raw), solo.checksum) == raw


def test_small_chunks_are_stored_whole() -> None:
    # a bias or a norm's weights: a delta would save a few bytes and cost a chain walk
    w = rng.standard_normal(4096).astype(np.float32)
    moved = w + np.float32(1e-4)
    small = encode_chunk(moved.tobytes(), w.tobytes(), 4)
    assert small.codec.startswith("none/")
    assert encode_chunk(w.tobytes(), w.tobytes(), 4).codec == REF  # unchanged: still shared
    big_w = np.tile(w, 8)  # 128 KiB
    assert is_delta(encode_chunk((big_w + np.float32(1e-4)).tobytes(), big_w.tobytes(), 4).codec)


def test_deltas_that_save_little_are_not_worth_a_chain_link() -> None:
    # values that moved by their own size: the delta saves 1-3%, and every later restore
    # in the chain would decode it, so the chunk is stored on its own
    local = np.random.default_rng(7)
    base = local.standard_normal(1 << 18).astype(np.float32)
    raw = (base * (1 + 2 * local.standard_normal(base.size))).astype(np.float32)
    anyway = encode_chunk(raw.tobytes(), base.tobytes(), 4, min_gain=0.0)
    alone = encode_chunk(raw.tobytes(), None, 4)
    assert is_delta(anyway.codec)
    assert (1 - DELTA_MIN_GAIN) * len(alone.payload) < len(anyway.payload) < len(alone.payload)
    chosen = encode_chunk(raw.tobytes(), base.tobytes(), 4)
    assert chosen.codec.startswith("none/") and chosen.payload == alone.payload
    roundtrip(raw.tobytes(), base.tobytes(), 4)


def _decayed_table(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """An embedding's Adam second moment 25 steps later: the rows of tokens seen in between
    got new values, the others only decayed (x 0.999 per step, rounded each time)."""
    local = np.random.default_rng(seed)
    table = np.abs(local.standard_normal((4096, 256))).astype(np.float32) * 1e-6
    moved = table.copy()
    for _ in range(25):
        moved *= np.float32(0.999)
    seen = local.random(4096) < 0.3
    moved[seen] = np.abs(local.standard_normal((int(seen.sum()), 256))).astype(np.float32) * 1e-6
    return moved, table


def test_rows_that_only_decayed_are_predicted_by_a_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    moved, table = _decayed_table(8)
    enc = encode_chunk(moved.tobytes(), table.tobytes(), 4)
    assert enc.codec.startswith("scale/1|zsub/1|planes4/")
    factor = struct.unpack_from("<f", enc.payload)[0]
    assert factor == pytest.approx(0.999**25, rel=1e-5)
    assert roundtrip(moved.tobytes(), table.tobytes(), 4) == enc.codec
    assert is_delta(enc.codec)
    monkeypatch.setattr(codec, "_scale_factor", lambda raw, base: None)
    plain = encode_chunk(moved.tobytes(), table.tobytes(), 4)
    assert not plain.codec.startswith("scale")
    assert len(enc.payload) < 0.75 * len(plain.payload)


def _scale_payload(factor_bits: int) -> bytes:
    # a factor, then one raw plane of 16 fp32 elements
    return struct.pack("<I", factor_bits) + struct.pack("<BBI", 1, 0, 64) + bytes(64)


@pytest.mark.parametrize(
    ("spec", "payload", "itemsize"),
    [
        ("scale/1|zsub/1|planes1/1|zstd/1", _scale_payload(0), 4),  # zero factor
        ("scale/1|zsub/1|planes1/1|zstd/1", _scale_payload(0x00000001), 4),  # subnormal
        ("scale/1|zsub/1|planes1/1|zstd/1", _scale_payload(0x7F800000), 4),  # infinity
        ("scale/1|zsub/1|planes1/1|zstd/1", _scale_payload(0x7FC00000), 4),  # NaN
        ("scale/1|zsub/1|planes1/1|zstd/1", b"\x00\x00", 4),  # truncated factor
        ("scale/1|xor/1|planes1/1|zstd/1", _scale_payload(0x3F000000), 4),  # not zsub
        ("scale/1|zsub/1|planes1/1|zstd/1", _scale_payload(0x3F000000), 2),  # not fp32
        ("scale/1|planes1/1|zstd/1", _scale_payload(0x3F000000), 4),  # no mode
    ],
)
def test_forged_scale_layers_are_corrupt_data(spec: str, payload: bytes, itemsize: int) -> None:
    with pytest.raises(CorruptData):
        decode_chunk(spec, payload, bytes(64), itemsize, 64, b"\0" * 16)


def test_a_scale_layer_decodes_onto_the_scaled_base() -> None:
    # the same payload as the forged ones above, with a valid factor (0.5) and a zero residual
    base = np.arange(1, 17, dtype=np.float32)
    want = (base * np.float32(0.5)).tobytes()
    spec = "scale/1|zsub/1|planes1/1|zstd/1"
    payload = _scale_payload(0x3F000000)
    assert decode_chunk(spec, payload, base.tobytes(), 4, 64, checksum(want)) == want


def test_drifting_bfloat16_roundtrip() -> None:
    w = rng.standard_normal(300_000).astype(np.float32)
    a = bf16_bits(w).tobytes()
    b = bf16_bits(w + rng.standard_normal(w.size).astype(np.float32) * 1e-3).tobytes()
    codec = roundtrip(b, a, 2)
    assert "planes2" in codec
    assert len(encode_chunk(b, a, 2).payload) < len(b)


def test_uncompressible_planes_are_stored_raw() -> None:
    # random mantissas, constant exponent: low planes are noise, the top plane compresses
    x = (1.0 + rng.random(200_000)).astype(np.float32)
    enc = encode_chunk(x.tobytes(), None, 4)
    assert enc.codec == "none/1|planes4/1|zstd/1"
    kinds = [enc.payload[1 + 5 * i] for i in range(4)]
    assert kinds[:2] == [0, 0] and kinds[3] == 1
    roundtrip(x.tobytes(), None, 4)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_small_steps_choose_a_subtraction(itemsize: int) -> None:
    """Steps of a few units either way: a subtraction (plain or zigzag) must win."""
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    base = rng.integers(0, 2 ** (8 * itemsize - 2), 200_000, dtype=dtype)
    steps = rng.integers(-3, 4, base.size).astype(np.int64).astype(dtype)
    raw = (base + steps).tobytes()  # wraps like the codec does
    codec = roundtrip(raw, base.tobytes(), itemsize)
    assert codec.split("/")[0] in ("sub", "zsub"), codec
    assert len(encode_chunk(raw, base.tobytes(), itemsize).payload) < len(raw) / 2


def test_empty_and_tiny_chunks() -> None:
    roundtrip(b"", None, 4)
    roundtrip(b"\x01\x02", b"\x01\x03", 2)
    roundtrip(b"\x00" * 8, None, 8)


def test_corruption_is_detected() -> None:
    w = rng.standard_normal(100_000).astype(np.float32)
    raw, base = (w * 1.001).tobytes(), w.tobytes()
    enc = encode_chunk(raw, base, 4)
    bad = bytearray(enc.payload)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(CorruptData):
        decode_chunk(enc.codec, bytes(bad), base, 4, len(raw), enc.checksum)
    with pytest.raises(CorruptData):  # wrong base
        decode_chunk(enc.codec, enc.payload, w[::-1].tobytes(), 4, len(raw), enc.checksum)
    with pytest.raises(CorruptData):  # truncated
        decode_chunk(enc.codec, enc.payload[:3], base, 4, len(raw), enc.checksum)
    with pytest.raises(CorruptData):
        decode_chunk("lz4/9|planes4/1|zstd/1", enc.payload, base, 4, len(raw), enc.checksum)
    with pytest.raises(CorruptData):
        decode_chunk("raw/1", raw, None, 4, len(raw), b"\0" * 16)


@pytest.mark.parametrize(
    ("plane", "raw_len"),
    [
        (struct.pack("<BI", 1, 0), 16),  # an empty zstd frame
        (struct.pack("<BI", 1, 9) + zstandard.ZstdCompressor().compress(b""), 0),  # no bytes
        (struct.pack("<BI", 1, 4) + b"junk", 16),
    ],
)
def test_forged_plane_tables_are_corrupt_data(plane: bytes, raw_len: int) -> None:
    payload = struct.pack("<B", 1) + plane
    with pytest.raises(CorruptData):
        decode_chunk("none/1|planes1/1|zstd/1", payload, None, 4, raw_len, b"\0" * 16)


def _zstd_plane(frame: bytes) -> bytes:
    return struct.pack("<BBI", 1, 1, len(frame)) + frame


@pytest.mark.parametrize(
    "frame",
    [
        zstandard.ZstdCompressor().compress(b"\1" * 32),  # states (and holds) 32 bytes, not 16
        zstandard.ZstdCompressor().compress(b"\1" * 8),  # too few
        # no stated size: the decoder would have to guess what to allocate
        zstandard.ZstdCompressor(write_content_size=False).compress(b"\1" * 16),
    ],
)
def test_zstd_planes_must_state_their_size(frame: bytes) -> None:
    with pytest.raises(CorruptData):
        decode_chunk("none/1|planes1/1|zstd/1", _zstd_plane(frame), None, 4, 16, b"\0" * 16)


def test_a_zstd_plane_of_the_stated_size_decodes() -> None:
    raw = b"\1" * 16
    frame = zstandard.ZstdCompressor().compress(raw)
    assert (
        decode_chunk("none/1|planes1/1|zstd/1", _zstd_plane(frame), None, 4, 16, checksum(raw))
        == raw
    )


def test_chunks_hold_the_same_elements_whatever_the_dtype() -> None:
    assert chunk_step(4, 1 << 20) == 1 << 20
    assert chunk_step(2, 1 << 20) == 1 << 19
    assert chunk_step(8, 100) == 200
    assert chunk_step(1, 4) == 1


def test_cast_prediction_matches_torch_rounding() -> None:
    import torch

    x = torch.randn(100_000, dtype=torch.float32) * 10
    x[:3] = torch.tensor([0.0, -0.0, float("inf")])
    src = x.numpy().tobytes()
    assert cast_prediction(src, "BF16") == x.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    assert cast_prediction(src, "F16") == x.to(torch.float16).numpy().tobytes()
    with pytest.raises(ValueError):
        cast_prediction(src, "F64")
    assert split_cast("cast-bf16/1|ref") == ("BF16", "ref")
    assert split_cast("zsub/1|planes2/1|zstd/1") is None


@settings(max_examples=200, deadline=None)
@given(
    itemsize=st.sampled_from([1, 2, 4, 8]),
    data=st.data(),
)
def test_property_roundtrip(itemsize: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 2000)) * itemsize
    raw = data.draw(st.binary(min_size=n, max_size=n))
    base = data.draw(st.one_of(st.none(), st.binary(min_size=n, max_size=n)))
    level = data.draw(st.sampled_from([1, 3]))
    roundtrip(raw, base, itemsize, level=level)


def test_mostly_zero_planes_are_stored_sparse() -> None:
    # a slowly moving fp32 tensor: the high bytes of the zigzag residual are nonzero in a
    # small share of the elements (where the exponent changes), so they are stored sparse
    local = np.random.default_rng(1)
    w = local.standard_normal(1 << 20).astype(np.float32)
    moved = w + local.standard_normal(len(w)).astype(np.float32) * 1e-3
    codec = roundtrip(moved.tobytes(), w.tobytes(), 4)
    assert codec == "zsub/1|planes4/2|zstd/1"
    enc = encode_chunk(moved.tobytes(), w.tobytes(), 4)
    kinds = [struct.unpack_from("<BI", enc.payload, 1 + 5 * i)[0] for i in range(4)]
    assert kinds == [0, 0, 2, 2]  # low bytes raw (noise), high bytes sparse
    # a residual that is zero but for a row of elements: those elements only, in runs
    row = w.copy()
    row[4096:4352] += np.float32(0.5)
    enc = encode_chunk(row.tobytes(), w.tobytes(), 4)
    assert enc.codec.startswith("zsub/1|runs/1|planes4/")
    assert len(enc.payload) < 1200  # 256 elements, not 1M
    assert roundtrip(row.tobytes(), w.tobytes(), 4) == enc.codec


def test_zero_runs_leave_out_untouched_rows() -> None:
    # fine-tuning moves the rows of the tokens it sees; the others keep a zero residual
    local = np.random.default_rng(2)
    table = local.standard_normal((4096, 256)).astype(np.float32)
    moved = table.copy()
    seen = local.random(4096) < 0.3
    moved[seen] += local.standard_normal((int(seen.sum()), 256)).astype(np.float32) * 1e-3
    codec = roundtrip(moved.tobytes(), table.tobytes(), 4)
    assert codec.startswith("zsub/1|runs/1|")
    with_runs = encode_chunk(moved.tobytes(), table.tobytes(), 4)
    # the kept elements' planes: about 30% of the chunk
    assert len(with_runs.payload) < 0.3 * 0.75 * len(moved.tobytes())
    # zeros as a keyframe (Adam moments of rows never seen) are left out too
    moments = np.where(seen[:, None], table, 0).astype(np.float32)
    assert roundtrip(moments.tobytes(), None, 4).startswith("none/1|runs/1|")
    # zeros scattered one by one are not worth runs
    scattered = np.where(local.random(table.shape) < 0.5, table, 0).astype(np.float32)
    assert "runs" not in roundtrip(scattered.tobytes(), None, 4)


def _sparse_payload(count: int, gap_len: int, stream: bytes) -> bytes:
    frame = zstandard.ZstdCompressor().compress(stream) if stream else b""
    body = struct.pack("<II", count, gap_len) + frame
    return struct.pack("<B", 1) + struct.pack("<BI", 2, len(body)) + body


@pytest.mark.parametrize(
    "payload",
    [
        _sparse_payload(1, 1, bytes([200, 7])),  # value past the end of the chunk
        _sparse_payload(2, 1, bytes([0, 7, 7])),  # fewer gaps than values
        _sparse_payload(1, 1, bytes([0, 7, 7])),  # frame longer than its header says
        _sparse_payload(17, 17, bytes(34)),  # more values than bytes in the chunk
        _sparse_payload(1, 500, bytes([255] * 499 + [0, 7])),  # more gap bytes than can be
        _sparse_payload(0, 0, bytes([1])),  # a frame for no values
        _sparse_payload(1, 1, b""),  # values and no frame
        _sparse_payload(0, 3, b""),  # gap bytes for no values
        struct.pack("<B", 1) + struct.pack("<BI", 2, 3) + b"abc",  # truncated header
    ],
)
def test_forged_sparse_planes_are_corrupt_data(payload: bytes) -> None:
    with pytest.raises(CorruptData):
        decode_chunk("none/1|planes1/2|zstd/1", payload, None, 4, 16, b"\0" * 16)


def test_a_sparse_plane_of_no_values_has_no_gaps() -> None:
    # count 0 with gap bytes would pass the length bounds of a 4 KiB plane
    with pytest.raises(CorruptData, match="sparse header"):
        decode_chunk("none/1|planes1/2|zstd/1", _sparse_payload(0, 3, b""), None, 4, 4096, b"")


def test_a_raw_chunk_of_partial_items_is_corrupt_data() -> None:
    with pytest.raises(CorruptData):
        decode_chunk("raw/1", b"abc", None, 2, 3, checksum(b"abc"))


def test_sparse_planes_need_the_planes_2_spec() -> None:
    raw = bytes([0] * 15 + [7])
    payload = _sparse_payload(1, 1, bytes([15, 7]))
    assert decode_chunk("none/1|planes1/2|zstd/1", payload, None, 4, 16, checksum(raw)) == raw
    with pytest.raises(CorruptData):  # planes/1 readers know raw and zstd planes only
        decode_chunk("none/1|planes1/1|zstd/1", payload, None, 4, 16, checksum(raw))


def _runs_payload(runs: list[int], planes_payload: bytes, count: int | None = None) -> bytes:
    frame = zstandard.ZstdCompressor().compress(np.array(runs, "<u4").tobytes())
    pairs = len(runs) // 2 if count is None else count
    return struct.pack("<II", pairs, len(frame)) + frame + planes_payload


def _raw_plane(data: bytes) -> bytes:
    return struct.pack("<B", 1) + struct.pack("<BI", 0, len(data)) + data


def test_runs_layers_decode() -> None:
    # 16 fp32 elements, elements 2-3 and 10 set: runs (2, 2) (6, 1)
    values = np.zeros(16, np.float32)
    values[[2, 3, 10]] = [1.0, 2.0, 3.0]
    payload = _runs_payload([2, 2, 6, 1], _raw_plane(values[[2, 3, 10]].tobytes()))
    raw = values.tobytes()
    spec = "none/1|runs/1|planes1/1|zstd/1"
    assert decode_chunk(spec, payload, None, 4, 64, checksum(raw)) == raw


@pytest.mark.parametrize(
    "payload",
    [
        _runs_payload([2, 2, 6, 1], _raw_plane(bytes(12)), count=0),  # no runs
        _runs_payload([2, 2, 6, 1], _raw_plane(bytes(12)), count=3),  # count and frame differ
        _runs_payload([2, 0, 6, 1], _raw_plane(bytes(4))),  # an empty run
        _runs_payload([2, 2, 0, 1], _raw_plane(bytes(12))),  # two runs that touch
        _runs_payload([2, 2, 16, 1], _raw_plane(bytes(12))),  # past the last element
        _runs_payload([2, 2, 6, 1], _raw_plane(bytes(8))),  # planes hold fewer elements
        _runs_payload([2, 2, 6, 1], b""),  # no planes at all
        _runs_payload([2, 2, 6, 1], _raw_plane(bytes(12)) + b"x"),  # bytes after the planes
        _runs_payload([1, 1] * 9, _raw_plane(bytes(36))),  # more runs than 16 elements hold
        struct.pack("<II", 1, 50) + b"short",  # truncated frame
        b"\x01\x00",  # truncated header
    ],
)
def test_forged_runs_are_corrupt_data(payload: bytes) -> None:
    with pytest.raises(CorruptData):
        decode_chunk("none/1|runs/1|planes1/1|zstd/1", payload, None, 4, 64, b"\0" * 16)


def test_the_numpy_reference_decodes_and_encodes_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # without numba (a client-only install) every layer still round-trips, to the same bytes
    from ckptstore_core import planes

    local = np.random.default_rng(3)
    table = local.standard_normal((2048, 256)).astype(np.float32)
    moved = table.copy()
    seen = local.random(2048) < 0.3
    moved[seen] += local.standard_normal((int(seen.sum()), 256)).astype(np.float32) * 1e-3
    drift = table + local.standard_normal(table.shape).astype(np.float32) * 1e-3
    decayed = _decayed_table(4)
    cases = [(moved, table), (drift, table), (table, None), decayed]
    fused = [encode_chunk(a.tobytes(), None if b is None else b.tobytes(), 4) for a, b in cases]
    monkeypatch.setattr(planes, "_KERNELS", None)
    for (a, b), enc in zip(cases, fused, strict=True):
        base = None if b is None else b.tobytes()
        assert encode_chunk(a.tobytes(), base, 4) == enc
        assert decode_chunk(enc.codec, enc.payload, base, 4, a.nbytes, enc.checksum) == a.tobytes()
    assert {c.codec.split("|")[1] for c in fused} >= {"runs/1", "planes4/2", "zsub/1"}
    assert fused[-1].codec.startswith("scale/1|")


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_chunks_too_short_for_planes_are_stored_raw_as_planes_would_be(
    itemsize: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The raw shortcut of short chunks changes no stored byte: every length it takes, the
    planes path (no frame assumed, the shortcut then covers only table-sized chunks) ends
    raw too, with the same payload."""
    rng = np.random.default_rng(itemsize)
    chunks = [
        data
        for n in range(1, 64)
        for data in (bytes(n * itemsize), rng.integers(0, 256, n * itemsize, np.uint8).tobytes())
    ]
    short = [codec.encode_chunk(c, None, itemsize) for c in chunks]
    assert any(codec._planes_lose(len(c), itemsize) for c in chunks)
    assert any(e.codec != codec.RAW for e in short)  # the longest go to planes
    monkeypatch.setattr(codec, "_MIN_FRAME", 0)
    planned = [codec.encode_chunk(c, None, itemsize) for c in chunks]
    assert [(e.codec, e.payload) for e in short] == [(e.codec, e.payload) for e in planned]


def test_planes_compressed_in_one_call_are_the_frames_of_compress_one_by_one() -> None:
    """A chunk's planes go to zstd in one call: its frames must be exactly those of one
    ``compress`` each (the stored bytes of every checkpoint depend on it), and outlive the
    call's own buffer."""
    rng = np.random.default_rng(7)
    values = (rng.standard_normal(1 << 16) * 1e-3).astype(np.float32)
    planes_ = [np.ascontiguousarray(values.view(np.uint8)[i::4]) for i in range(4)]
    jobs = [p.data for p in planes_] + [b"", bytes(1000), rng.bytes(3000)]
    level = 1
    frames = codec._compress(jobs, level)
    one_by_one = [codec._cctx(level).compress(job) for job in jobs]
    assert [bytes(f) for f in frames] == one_by_one
    del jobs, planes_
    dctx = zstandard.ZstdDecompressor()
    assert dctx.decompress(frames[5]) == bytes(1000)
    # one job: one compress
    assert [bytes(f) for f in codec._compress([b"abc"], level)] == [
        codec._cctx(level).compress(b"abc")
    ]


def test_a_chain_decodes_onto_its_raw_first_link_however_that_is_held() -> None:
    """The first delta reads a raw first link (a kept chunk) in its join, the next ones apply
    in place: the same bytes whether that link is bytes, a bytearray, a view at an odd
    address or a strided one, and the link itself untouched."""
    n = 1 << 15
    w0 = rng.standard_normal(n).astype(np.float32)
    w1 = w0 + (rng.standard_normal(n) * 1e-4).astype(np.float32)  # no one scale: no scale link
    w1[: n // 4] = w0[: n // 4]  # untouched rows: the deltas leave them out (runs)
    w2 = w1 + np.float32(1e-4)
    w2[n // 2 :] = w1[n // 2 :]
    e1, e2 = (
        encode_chunk(w1.tobytes(), w0.tobytes(), 4),
        encode_chunk(w2.tobytes(), w1.tobytes(), 4),
    )
    assert codec.is_delta(e1.codec) and codec.is_delta(e2.codec)
    assert "scale" not in e1.codec and "runs" in e1.codec and "runs" in e2.codec, (e1, e2)
    tail = [(e1.codec, e1.payload), (e2.codec, e2.payload)]
    raw0 = w0.tobytes()
    strided = np.zeros(2 * len(raw0), np.uint8)
    strided[::2] = np.frombuffer(raw0, np.uint8)
    firsts = [
        raw0,
        bytearray(raw0),
        memoryview(b"\0" + raw0)[1:],  # unaligned: copied, then joined in place
        memoryview(strided)[::2],  # not contiguous
        memoryview(w0.copy()).cast("B"),
    ]
    for first in firsts:
        held = bytes(first)
        out = codec.decode_chain([(codec.RAW, first), *tail], 4, len(raw0), e2.checksum)
        assert bytes(out) == w2.tobytes(), type(first)
        assert bytes(first) == held
